"""Token-id prompts built segment by segment, and the per-request `kv_transfer_params` plan."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbench.contracts import Plan, PlanSegment, SegmentKind
from kvbench.tracegen.schema import OUT_PREFIX, Segment, Trajectory, Turn
from kvbench.tracegen.tokenizer import TraceTokenizer


@dataclass
class SegmentSpan:
    kind: SegmentKind
    id: str  # "system", "text", or the ph key ("q", "out:A0.r0")
    start: int
    length: int


@dataclass
class TurnPrompt:
    token_ids: list[int]
    spans: list[SegmentSpan]
    plan: Plan = field(default_factory=lambda: Plan("", "", "", None))

    @property
    def shared_tokens(self) -> int:
        return sum(s.length for s in self.spans if s.kind == "ph")

    @property
    def reusable_tokens(self) -> int:
        """PH rows a perfect reuse would serve: rows some earlier turn's cache holds with K/V (a
        producer's own last generated token never got any), before the prompt's last token
        (which vLLM always computes)."""
        return reusable_rows(self.plan.segments, len(self.token_ids))


def reusable_rows(segments: Sequence[PlanSegment], prompt_len: int) -> int:
    """The rows of a plan's PH segments that name a source holding them with K/V (not a
    producer's own last generated token), before the prompt's last token."""
    total = 0
    for segment in segments:
        if segment.kind != "ph" or not segment.source:
            continue
        stop = min(segment.start + segment.length, prompt_len - 1)
        if segment.id == OUT_PREFIX + str(segment.source_turn):
            stop = min(stop, segment.start + segment.length - 1)
        total += max(0, stop - segment.start)
    return total


def cache_key(run_id: str, trajectory_id: str, turn_id: str) -> str:
    """Where a finished turn's K/V is saved on the server; run-scoped so reruns never collide."""
    return f"{run_id}/{trajectory_id}/{turn_id}"


class PromptBuilder:
    """Builds each turn's prompt from the trace and the real outputs of earlier turns."""

    def __init__(self, tokenizer: TraceTokenizer, prefix_ids: list[int], run_id: str,
                 reference_outputs: Mapping[tuple[str, str], list[int]] | None = None,
                 drop_shared: bool = False, keep_unread_caches: bool = True, concurrent_sources: bool = True) -> None:
        """`reference_outputs` (trajectory id, turn id) -> output ids: a reference run's outputs,
        fed to later turns instead of this run's own where it has them (reference-anchored
        replay). `drop_shared`: every shared segment left out of every prompt (the no-context
        floor of PGR). `keep_unread_caches`: the server keeps every turn's cache, also those no
        later turn reads (what KV-error measurements compare afterwards). `concurrent_sources`: a
        shared segment no predecessor holds is read from a turn running at the same time that
        was sent first (Trajectory.concurrent_holders), as soon as that turn's prompt is computed."""
        self.tokenizer = tokenizer
        self.prefix_ids = list(prefix_ids)
        self.run_id = run_id
        self.reference_outputs = reference_outputs
        self.drop_shared = drop_shared
        self.keep_unread_caches = keep_unread_caches
        self.concurrent_sources = concurrent_sources
        # Several servers sharing caches (Mooncake Store): a finished turn's cache is readable on
        # every server; a turn still running is read only on its own (its prompt is saved locally).
        self.shared_tier = False
        self._read: dict[str, set[str]] = {}  # trajectory id -> read_caches
        self._concurrent: dict[str, set[str]] = {}  # trajectory id -> concurrent_sources
        self._text_ids: dict[str, list[int]] = {}

    def _ids_of_text(self, text: str) -> list[int]:
        if text not in self._text_ids:
            self._text_ids[text] = self.tokenizer.encode(text)
        return self._text_ids[text]

    def segment_ids(self, trajectory: Trajectory, turn: Turn, segment: Segment,
                    outputs: dict[str, list[int]]) -> list[int]:
        if segment.pf == "system":
            return self._ids_of_text(trajectory.agents[turn.agent].system)
        if segment.pf == "text":
            return self._ids_of_text(segment.text or "")
        assert segment.ph is not None
        if segment.ph.startswith(OUT_PREFIX):
            producer = segment.ph[len(OUT_PREFIX):]
            if self.reference_outputs is not None:
                reference = self.reference_outputs.get((trajectory.trajectory_id, producer))
                if reference is not None:
                    return self.tokenizer.message_ids(reference)
            # an agent passes on its message: up to its end of sequence, no control token (outputs
            # are the generated ids as recorded, by this run or rebuilt from its files)
            return self.tokenizer.message_ids(outputs[producer])
        ids = self._ids_of_text(trajectory.shared[segment.ph].text)
        expected = trajectory.shared[segment.ph].num_tokens
        if len(ids) != expected:
            raise ValueError(f"trajectory {trajectory.trajectory_id}: shared segment {segment.ph!r} has "
                             f"{len(ids)} tokens under {self.tokenizer.name}, the trace says {expected}; "
                             "was it generated for another tokenizer?")
        return ids

    def build(self, trajectory: Trajectory, turn: Turn, outputs: dict[str, list[int]],
              prompts: dict[str, TurnPrompt], started: Mapping[str, TurnPrompt] | None = None,
              placed: Mapping[str, str] | None = None) -> TurnPrompt:
        """`outputs`/`prompts`: generated ids and prompts of the trajectory's finished turns;
        `started`: the prompts of its turns sent and not finished yet; `placed`: the server of each
        turn sent, this one's included, when the run has several (a cache is read only where it is)."""
        token_ids = list(self.prefix_ids)
        spans: list[SegmentSpan] = []
        for segment in turn.segments:
            if self.drop_shared and segment.ph is not None:
                continue
            ids = self.segment_ids(trajectory, turn, segment, outputs)
            kind, key = ("ph", segment.ph) if segment.ph is not None else ("pf", segment.pf or "")
            spans.append(SegmentSpan(kind, key, len(token_ids), len(ids)))
            token_ids += ids
        prompt = TurnPrompt(token_ids, spans)
        prompt.plan = self.plan(trajectory, turn, prompt, outputs, prompts, started or {}, placed)
        return prompt

    def plan(self, trajectory: Trajectory, turn: Turn, prompt: TurnPrompt, outputs: dict[str, list[int]],
             prompts: dict[str, TurnPrompt], started: Mapping[str, TurnPrompt] | None = None,
             placed: Mapping[str, str] | None = None) -> Plan:
        """Workload facts only (method parameters live in the server's connector config), so one
        trace replays against every method unchanged."""
        segments = []
        sent = {**(started or {}), **prompts}
        if placed is not None:  # several servers: only the caches of turns on this one are readable
            sent = {t: p for t, p in sent.items()
                    if placed.get(t) == placed.get(turn.turn_id) or (self.shared_tier and t in prompts)}
        for span in prompt.spans:
            source = self._source(trajectory, turn, span, sent)
            if source is None:
                segments.append(PlanSegment(span.kind, span.id, span.start, span.length))
                continue
            segments.append(PlanSegment(
                span.kind, span.id, span.start, span.length,
                source=cache_key(self.run_id, trajectory.trajectory_id, source),
                source_start=_start_in_cache(span.id, source, sent[source]), source_turn=source,
                source_agent=trajectory.turn_by_id[source].agent,
                source_adapter=trajectory.agents[trajectory.turn_by_id[source].agent].adapter))
        # The agent's own finished turns: its prompt may start with one of theirs, copied exactly.
        own = [t for t in trajectory.turns if t.agent == turn.agent and t.turn_id in prompts and t.turn_id != turn.turn_id
               and t.turn_id in sent]
        return Plan(trajectory=trajectory.trajectory_id, turn=turn.turn_id, agent=turn.agent,
                    save_as=cache_key(self.run_id, trajectory.trajectory_id, turn.turn_id), segments=tuple(segments),
                    prefix_sources=tuple(cache_key(self.run_id, trajectory.trajectory_id, t.turn_id) for t in own),
                    keep_cache=self.keep_unread_caches or turn.turn_id in self._read_caches(trajectory),
                    adapter=trajectory.agents[turn.agent].adapter,
                    readable_after_prefill=turn.turn_id in self._concurrent_sources(trajectory),
                    sources_in_flight=tuple(sorted({s.source for s in segments if s.source and s.source_turn is not None
                                                    and s.source_turn not in prompts})))

    def _source(self, trajectory: Trajectory, turn: Turn, span: SegmentSpan, sent: Mapping[str, TurnPrompt]) -> str | None:
        """The turn whose cache this PH span is read from: the latest predecessor holding it, else
        (concurrent_sources) the earliest concurrent turn holding it that was sent already."""
        if span.kind != "ph":
            return None
        source = trajectory.source_of(turn, span.id)
        if source is not None and source not in sent:
            return None  # its cache is on another server
        if source is None and self.concurrent_sources:
            source = next((t for t in trajectory.concurrent_holders(turn, span.id) if t in sent), None)
        return source

    def _read_caches(self, trajectory: Trajectory) -> set[str]:
        if trajectory.trajectory_id not in self._read:
            self._read[trajectory.trajectory_id] = read_caches(trajectory) | self._concurrent_sources(trajectory)
        return self._read[trajectory.trajectory_id]

    def _concurrent_sources(self, trajectory: Trajectory) -> set[str]:
        if not self.concurrent_sources or self.drop_shared:
            return set()
        if trajectory.trajectory_id not in self._concurrent:
            self._concurrent[trajectory.trajectory_id] = concurrent_sources(trajectory)
        return self._concurrent[trajectory.trajectory_id]


def read_caches(trajectory: Trajectory) -> set[str]:
    """Turns whose cache a later turn may read: the source of one of its shared segments, or an
    earlier turn of its own agent (a prefix source, see PromptBuilder.plan) that may have finished
    before it starts."""
    read = {source for turn in trajectory.turns for ph in trajectory.shared_keys(turn)
            if (source := trajectory.source_of(turn, ph)) is not None}
    for turn in trajectory.turns:
        if any(other.agent == turn.agent and other.turn_id != turn.turn_id
               and not trajectory.is_ancestor(other.turn_id, turn.turn_id) for other in trajectory.turns):
            read.add(turn.turn_id)
    return read


def concurrent_sources(trajectory: Trajectory) -> set[str]:
    """Turns a concurrent turn may read a shared segment from (Trajectory.concurrent_holders of a
    segment no predecessor holds): their prompt is saved as soon as it is computed."""
    return {holder for turn in trajectory.turns for ph in trajectory.shared_keys(turn)
            if trajectory.source_of(turn, ph) is None for holder in trajectory.concurrent_holders(turn, ph)}


def _start_in_cache(ph: str, source_turn: str, source_prompt: TurnPrompt) -> int:
    """Offset of segment `ph` in the source turn's cache (its prompt followed by its output)."""
    if ph == OUT_PREFIX + source_turn:
        return len(source_prompt.token_ids)
    for span in source_prompt.spans:
        if span.kind == "ph" and span.id == ph:
            return span.start
    raise KeyError(f"segment {ph!r} is not in the cache of {source_turn!r}")
