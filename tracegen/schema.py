"""The `kvbench-trace` format (version 2; version 1 is read too): the one schema every stage reads and writes.

A trace is JSON Lines. Line 1 is a `TraceHeader`; every further line is one `Trajectory`.
Structure is checked by pydantic; cross-references (agents, turns, `ph` sources, cycles) by
`reference_problems`, on the parsed JSON. Every problem becomes a `TraceError` naming line and field.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvbench.tracegen.graph import ancestor_masks, bits_descending, find_cycle, topological_order

TRACE_FORMAT = "kvbench-trace"
# 2: agents may name a LoRA adapter (`Agent.adapter`, listed in `TraceHeader.adapters`). Version 1
# traces (no adapters) are read as they are.
TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)
OUT_PREFIX = "out:"
# Bounds far past any real workload, so that a typo (or a fuzzer) cannot ask the replayer for
# 10^12 tokens or an arrival a million years away.
MAX_SEGMENT_TOKENS = 1 << 22
MAX_OUTPUT_TOKENS = 1 << 20
MAX_ARRIVAL_S = 1e9
# Reading is bounded before anything is parsed or tokenized: a line (one trajectory) and a text
# (a shared segment, a system prompt) larger than these are refused with the limit's name. A 32K-
# token context is about 150 KB of text; raise them through the environment for larger ones.
MAX_LINE_BYTES_ENV, MAX_TEXT_BYTES_ENV = "KVBENCH_MAX_TRACE_LINE_BYTES", "KVBENCH_MAX_TRACE_TEXT_BYTES"
DEFAULT_MAX_LINE_BYTES = 16 << 20
DEFAULT_MAX_TEXT_BYTES = 4 << 20


def _limit(env: str, default: int) -> int:
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not a number of bytes") from None
    if value < 1:
        raise ValueError(f"{env}={raw!r} must be at least 1 byte")
    return value


def max_line_bytes() -> int:
    return _limit(MAX_LINE_BYTES_ENV, DEFAULT_MAX_LINE_BYTES)


def max_text_bytes() -> int:
    return _limit(MAX_TEXT_BYTES_ENV, DEFAULT_MAX_TEXT_BYTES)


class TraceError(ValueError):
    """A malformed trace. `problems` holds one 'line N: field: message' string per problem."""

    def __init__(self, path: str | Path, problems: list[str], what: str = "trace") -> None:
        self.path = str(path)
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__(f"invalid {what} {path}:\n  " + "\n  ".join(shown))


def _check_identifier(value: str) -> str:
    """Ids travel in request ids, HTTP headers, cache keys and file names: printable text only."""
    if not value:
        raise ValueError("must not be empty")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(f"must be printable text (holds {bad!r})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be encodable text (holds {value[exc.start]!r}, a lone surrogate)") from None
    return value


Identifier = Annotated[str, AfterValidator(_check_identifier)]


def _check_text_size(value: str) -> str:
    limit = max_text_bytes()
    if len(value) > limit // 4 and len(value.encode("utf-8", "surrogatepass")) > limit:  # cheap test first
        raise ValueError(f"text larger than {limit} bytes ({MAX_TEXT_BYTES_ENV} raises the limit)")
    return value


Text = Annotated[str, AfterValidator(_check_text_size)]


class _Strict(BaseModel):
    # strict: an integer field takes no bool or string ("4", true), as JSON means them
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


MAX_GENERATOR_DEPTH = 16


def _check_depth(value: dict[str, Any]) -> dict[str, Any]:
    """The generator's parameters are copied into every run's config: nesting deeper than
    parameters ever go would only break serializers there."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_GENERATOR_DEPTH:
            raise ValueError(f"nested more than {MAX_GENERATOR_DEPTH} levels deep")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack += [(child, depth + 1) for child in children]
    return value


class TraceHeader(_Strict):
    format: Literal["kvbench-trace"]
    version: Literal[1, 2]
    generator: Annotated[dict[str, Any], AfterValidator(_check_depth)]
    tokenizer: str
    tokenizer_sha256: str | None = None
    # Token ids the tokenizer puts before any text (e.g. Llama-3's BOS); prompts start with them.
    prompt_prefix_ids: list[int] = Field(default_factory=list)
    # The LoRA adapters agents use (version 2): name -> its PEFT folder, which the server loads
    # (`--lora-modules name=path`) and requests name in `model`. None: every agent is the base model.
    adapters: dict[Identifier, str] | None = None


class Agent(_Strict):
    role: str
    system: Text
    system_tokens: int = Field(ge=0, le=MAX_SEGMENT_TOKENS)
    adapter: Identifier | None = None  # a LoRA adapter of the header's `adapters`; None: the base model


class SharedText(_Strict):
    text: Text
    num_tokens: int = Field(ge=0, le=MAX_SEGMENT_TOKENS)


class Segment(_Strict):
    """One prompt segment: agent-specific (`pf`: the agent's system prompt, or glue text) or shared
    (`ph`: a key of the trajectory's `shared`, or `out:<turn_id>`, an earlier turn's output)."""

    pf: Literal["system", "text"] | None = None
    ph: str | None = None
    text: Text | None = None
    num_tokens: int | None = Field(default=None, ge=0, le=MAX_SEGMENT_TOKENS)

    @model_validator(mode="after")
    def _one_kind(self) -> Segment:
        if (self.pf is None) == (self.ph is None):
            raise ValueError("a segment has exactly one of 'pf' or 'ph'")
        if self.pf == "text" and (self.text is None or self.num_tokens is None):
            raise ValueError("a 'pf': 'text' segment needs 'text' and 'num_tokens'")
        if self.pf != "text" and (self.text is not None or self.num_tokens is not None):
            raise ValueError("only 'pf': 'text' segments carry 'text' and 'num_tokens'")
        return self

    @property
    def is_shared(self) -> bool:
        return self.ph is not None


class Turn(_Strict):
    turn_id: Identifier
    agent: Identifier
    after: list[Identifier] = Field(default_factory=list)
    max_tokens: int = Field(ge=1, le=MAX_OUTPUT_TOKENS)
    segments: list[Segment] = Field(min_length=1)
    # Absent: exactly max_tokens are generated (controlled workloads); true: the model's end of
    # sequence may end the output earlier (benchmark workloads, whose answers end where the model ends them)
    stop_at_eos: bool | None = None


class TurnAnswer(_Strict):
    """The gold answer of one turn of a task trajectory."""

    turn_id: Identifier
    answer: str = Field(min_length=1)
    # recall tasks: where the record holding the answer starts in its shared segment, as a share
    # of its tokens (benchmark items have no such place: None)
    position: float | None = Field(default=None, ge=0, le=1)


class Task(_Strict):
    """A scorable task: the gold answer of the turns that are scored, and which turn's answer is
    the trajectory's final one. `name` is a task of kvbench.tracegen.tasks (`recall` and
    `role-recall`: constructed, every turn scored; `mmlu`, `gsm8k`, `humaneval`: a benchmark item,
    the final agent's answer scored), which reads and grades the answers (`kvbench score` names an
    unknown one)."""

    name: Identifier
    answers: list[TurnAnswer] = Field(min_length=1)
    final_turn: Identifier
    item_id: Identifier | None = None  # the benchmark item's id (its row, or HumanEval's task_id)
    # HumanEval: the item's `check` function and the name it is called with; the prompt is the
    # shared question
    test: Text | None = None
    entry_point: Identifier | None = None


class Trajectory(_Strict):
    trajectory_id: Identifier
    arrival_s: float = Field(ge=0, le=MAX_ARRIVAL_S)
    agents: dict[Identifier, Agent] = Field(min_length=1)
    shared: dict[Identifier, SharedText] = Field(default_factory=dict)
    turns: list[Turn] = Field(min_length=1)
    task: Task | None = None

    @cached_property
    def turn_by_id(self) -> dict[str, Turn]:
        return {t.turn_id: t for t in self.turns}

    @cached_property
    def _index(self) -> dict[str, int]:
        return {t.turn_id: i for i, t in enumerate(self.turns)}

    @cached_property
    def _ancestor_masks(self) -> dict[str, int]:
        after = {t.turn_id: t.after for t in self.turns}
        order = topological_order(after)
        if order is None:
            raise ValueError(f"trajectory {self.trajectory_id}: dependency cycle {' -> '.join(find_cycle(after))}")
        return ancestor_masks(order, after, self._index)

    def is_ancestor(self, candidate: str, turn_id: str) -> bool:
        """Whether `turn_id` waits, transitively, for `candidate`."""
        return bool(self._ancestor_masks[turn_id] >> self._index[candidate] & 1)

    @cached_property
    def ancestors(self) -> dict[str, set[str]]:
        """Transitive `after` closure of every turn (as sets: for small trajectories and tests)."""
        return {t: {self.turns[i].turn_id for i in bits_descending(mask)} for t, mask in self._ancestor_masks.items()}

    def segment_tokens(self, segment: Segment, turn: Turn) -> int:
        """Token count of a segment; an `out:` segment counts its producer's `max_tokens`."""
        if segment.pf == "system":
            return self.agents[turn.agent].system_tokens
        if segment.pf == "text":
            return segment.num_tokens or 0
        assert segment.ph is not None
        if segment.ph.startswith(OUT_PREFIX):
            return self.turn_by_id[segment.ph[len(OUT_PREFIX):]].max_tokens
        return self.shared[segment.ph].num_tokens

    def prompt_tokens(self, turn: Turn) -> int:
        return sum(self.segment_tokens(s, turn) for s in turn.segments)

    def shared_keys(self, turn: Turn) -> list[str]:
        return [s.ph for s in turn.segments if s.ph is not None]

    def cache_keys(self, turn: Turn) -> set[str]:
        """PH segments whose K/V a turn's cache holds once it finished: its prompt's and its output."""
        return set(self.shared_keys(turn)) | {OUT_PREFIX + turn.turn_id}

    def source_of(self, turn: Turn, ph: str) -> str | None:
        """The turn whose cache a method reuses for `ph` in `turn`: the latest predecessor holding it.

        Prefers direct predecessors (the workflow edge i -> j that chained correction follows),
        then other ancestors, latest in trace order; None when no earlier cache holds it.
        """
        direct = sorted(turn.after, key=self._index.__getitem__, reverse=True)
        for candidate in direct:
            if ph in self.cache_keys(self.turn_by_id[candidate]):
                return candidate
        for index in bits_descending(self._ancestor_masks[turn.turn_id]):
            candidate = self.turns[index]
            if candidate.turn_id not in turn.after and ph in self.cache_keys(candidate):
                return candidate.turn_id
        return None

    def concurrent_holders(self, turn: Turn, ph: str) -> list[str]:
        """Earlier turns (in trace order) that may run at the same time as `turn` and whose prompt
        holds `ph`, earliest first: neither waits for the other, so each may read the other's
        prompt as soon as it is computed. Only a shared context known up front (an output is read
        by its producer's successors alone)."""
        if ph.startswith(OUT_PREFIX):
            return []
        index = self._index[turn.turn_id]
        return [other.turn_id for other in self.turns[:index]
                if ph in self.shared_keys(other) and not self.is_ancestor(other.turn_id, turn.turn_id)
                and not self.is_ancestor(turn.turn_id, other.turn_id)]


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def reference_problems(obj: Any) -> list[str]:
    """Cross-field problems of one trajectory (agents, turn ids, `after`, `ph` sources, cycles) as
    'field: message' strings. Works on the parsed JSON, well-typed or not, so that a bad
    reference is reported beside the field errors of the same line rather than hidden by them;
    values of the wrong type are skipped here (the schema reports them)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("turns"), list):
        return []
    agents = obj.get("agents") if isinstance(obj.get("agents"), dict) else None
    shared = obj.get("shared") if isinstance(obj.get("shared"), dict) else {}
    turns = [t if isinstance(t, dict) else {} for t in obj["turns"]]
    ids = [t.get("turn_id") if isinstance(t.get("turn_id"), str) else None for t in turns]
    problems: list[str] = []
    seen: set[str] = set()
    for i, turn_id in enumerate(ids):
        if turn_id is not None and turn_id in seen:
            problems.append(f"turns[{i}].turn_id: duplicate turn id {turn_id!r}")
        if turn_id is not None:
            seen.add(turn_id)
    after = {turn_id: _strings(turn.get("after")) for turn_id, turn in zip(ids, turns) if turn_id is not None}
    for i, turn in enumerate(turns):
        where = f"turns[{i}]"
        if agents is not None and isinstance(turn.get("agent"), str) and turn["agent"] not in agents:
            problems.append(f"{where}.agent: unknown agent {turn['agent']!r}")
        listed: set[str] = set()
        for j, dep in enumerate(turn.get("after") if isinstance(turn.get("after"), list) else []):
            if not isinstance(dep, str):
                continue
            if dep in listed:
                problems.append(f"{where}.after[{j}]: {dep!r} is listed twice")
            listed.add(dep)
            if dep not in seen:
                problems.append(f"{where}.after[{j}]: unknown turn {dep!r}")
            elif dep == ids[i]:
                problems.append(f"{where}.after[{j}]: turn depends on itself")
    order = topological_order(after)
    if order is None:
        cycle = find_cycle(after)
        shown = cycle if len(cycle) <= 12 else [*cycle[:5], "...", *cycle[-5:]]
        problems.append(f"turns.after: dependency cycle {' -> '.join(shown)} ({len(cycle) - 1} turns)")
        return problems  # which outputs a turn can see is undefined
    index = {turn_id: i for i, turn_id in enumerate(ids) if turn_id is not None}
    masks = ancestor_masks(order, after, index)
    for i, turn in enumerate(turns):
        segments = turn.get("segments") if isinstance(turn.get("segments"), list) else []
        for k, segment in enumerate(segments):
            ph = segment.get("ph") if isinstance(segment, dict) else None
            if not isinstance(ph, str):
                continue
            where = f"turns[{i}].segments[{k}].ph"
            if ph.startswith(OUT_PREFIX):
                source = ph[len(OUT_PREFIX):]
                if source not in seen:
                    problems.append(f"{where}: unknown turn {source!r}")
                elif ids[i] is None or not masks[ids[i]] >> index[source] & 1:
                    problems.append(f"{where}: turn {source!r} is not among this turn's predecessors "
                                    "('after', transitively), so its output is not known yet")
            elif ph not in shared:
                problems.append(f"{where}: unknown shared segment {ph!r}")
    task = obj.get("task")
    if isinstance(task, dict):
        answers = task.get("answers") if isinstance(task.get("answers"), list) else []
        for k, answer in enumerate(answers):
            turn_id = answer.get("turn_id") if isinstance(answer, dict) else None
            if isinstance(turn_id, str) and turn_id not in seen:
                problems.append(f"task.answers[{k}].turn_id: unknown turn {turn_id!r}")
        final = task.get("final_turn")
        if isinstance(final, str) and final not in {a.get("turn_id") for a in answers if isinstance(a, dict)}:
            problems.append(f"task.final_turn: {final!r} has no answer in task.answers")
    return problems


class Trace(BaseModel):
    """A whole trace in memory."""

    model_config = ConfigDict(frozen=True)
    header: TraceHeader
    trajectories: list[Trajectory]
    # the file line of each trajectory, for messages (a trace made in memory: its would-be lines)
    line_numbers: list[int] = Field(default_factory=list)

    def line_of(self, index: int) -> int:
        return self.line_numbers[index] if index < len(self.line_numbers) else index + 2
