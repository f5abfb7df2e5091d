"""The `kvbench-trace` v1 format: the one schema every stage reads and writes.

A trace is JSON Lines. Line 1 is a `TraceHeader`; every further line is one `Trajectory`.
Structure is checked by pydantic; cross-references (agents, turns, `ph` sources, cycles) by
`Trajectory.check_references`. Every problem becomes a `TraceError` naming line and field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TRACE_FORMAT = "kvbench-trace"
TRACE_VERSION = 1
OUT_PREFIX = "out:"


class TraceError(ValueError):
    """A malformed trace. `problems` holds one 'line N: field: message' string per problem."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.path = str(path)
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__(f"invalid trace {path}:\n  " + "\n  ".join(shown))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TraceHeader(_Strict):
    format: Literal["kvbench-trace"]
    version: Literal[1]
    generator: dict[str, Any]
    tokenizer: str
    tokenizer_sha256: str | None = None
    # Token ids the tokenizer puts before any text (e.g. Llama-3's BOS); prompts start with them.
    prompt_prefix_ids: list[int] = Field(default_factory=list)


class Agent(_Strict):
    role: str
    system: str
    system_tokens: int = Field(ge=0)


class SharedText(_Strict):
    text: str
    num_tokens: int = Field(ge=0)


class Segment(_Strict):
    """One prompt segment: agent-specific (`pf`: the agent's system prompt, or glue text) or shared
    (`ph`: a key of the trajectory's `shared`, or `out:<turn_id>`, an earlier turn's output)."""

    pf: Literal["system", "text"] | None = None
    ph: str | None = None
    text: str | None = None
    num_tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_kind(self) -> "Segment":
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
    turn_id: str = Field(min_length=1)
    agent: str
    after: list[str] = Field(default_factory=list)
    max_tokens: int = Field(ge=1)
    segments: list[Segment] = Field(min_length=1)


class Trajectory(_Strict):
    trajectory_id: str = Field(min_length=1)
    arrival_s: float = Field(ge=0)
    agents: dict[str, Agent] = Field(min_length=1)
    shared: dict[str, SharedText] = Field(default_factory=dict)
    turns: list[Turn] = Field(min_length=1)

    def check_references(self) -> list[str]:
        """Cross-field problems as 'field: message' strings (empty when the trajectory is sound)."""
        problems: list[str] = []
        ids = [t.turn_id for t in self.turns]
        seen: set[str] = set()
        for i, turn_id in enumerate(ids):
            if turn_id in seen:
                problems.append(f"turns[{i}].turn_id: duplicate turn id {turn_id!r}")
            seen.add(turn_id)
        for i, turn in enumerate(self.turns):
            where = f"turns[{i}]"
            if turn.agent not in self.agents:
                problems.append(f"{where}.agent: unknown agent {turn.agent!r}")
            for j, dep in enumerate(turn.after):
                if dep not in seen:
                    problems.append(f"{where}.after[{j}]: unknown turn {dep!r}")
                elif dep == turn.turn_id:
                    problems.append(f"{where}.after[{j}]: turn depends on itself")
        if problems:
            return problems
        if cycle := self._find_cycle():
            return [f"turns.after: dependency cycle {' -> '.join(cycle)}"]
        ancestors = self.ancestors
        for i, turn in enumerate(self.turns):
            for k, segment in enumerate(turn.segments):
                if segment.ph is None:
                    continue
                where = f"turns[{i}].segments[{k}].ph"
                if segment.ph.startswith(OUT_PREFIX):
                    source = segment.ph[len(OUT_PREFIX):]
                    if source not in seen:
                        problems.append(f"{where}: unknown turn {source!r}")
                    elif source not in ancestors[turn.turn_id]:
                        problems.append(f"{where}: turn {source!r} is not among this turn's predecessors "
                                        "('after', transitively), so its output is not known yet")
                elif segment.ph not in self.shared:
                    problems.append(f"{where}: unknown shared segment {segment.ph!r}")
        return problems

    def _find_cycle(self) -> list[str] | None:
        graph = {t.turn_id: t.after for t in self.turns}
        state: dict[str, int] = {}  # 1 = on the current path, 2 = done

        def visit(node: str, path: list[str]) -> list[str] | None:
            state[node] = 1
            for dep in graph[node]:
                if state.get(dep) == 1:
                    return path[path.index(dep):] + [dep] if dep in path else [node, dep]
                if dep not in state and (found := visit(dep, path + [dep])):
                    return found
            state[node] = 2
            return None

        for node in graph:
            if node not in state and (found := visit(node, [node])):
                return found
        return None

    @cached_property
    def turn_by_id(self) -> dict[str, Turn]:
        return {t.turn_id: t for t in self.turns}

    @cached_property
    def ancestors(self) -> dict[str, set[str]]:
        """Transitive `after` closure of every turn (call only on an acyclic trajectory)."""
        result: dict[str, set[str]] = {}

        def closure(turn_id: str) -> set[str]:
            if turn_id not in result:
                deps = self.turn_by_id[turn_id].after
                result[turn_id] = set(deps).union(*(closure(d) for d in deps))
            return result[turn_id]

        for turn in self.turns:
            closure(turn.turn_id)
        return result

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
        order = {t.turn_id: i for i, t in enumerate(self.turns)}
        direct = sorted(turn.after, key=order.__getitem__, reverse=True)
        indirect = sorted(self.ancestors[turn.turn_id] - set(turn.after), key=order.__getitem__, reverse=True)
        for candidate in direct + indirect:
            if ph in self.cache_keys(self.turn_by_id[candidate]):
                return candidate
        return None


class Trace(BaseModel):
    """A whole trace in memory."""

    model_config = ConfigDict(frozen=True)
    header: TraceHeader
    trajectories: list[Trajectory]


def _format_validation_error(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        field = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in item["loc"]).replace(".[", "[")
        problems.append(f"{field or '(line)'}: {item['msg']}")
    return problems


def parse_header(line: str, path: str | Path = "<trace>") -> TraceHeader:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(path, [f"line 1: not JSON ({exc.msg})"]) from None
    if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
        raise TraceError(path, [f"line 1: format: expected a header with \"format\": \"{TRACE_FORMAT}\""])
    if obj.get("version") != TRACE_VERSION:
        raise TraceError(path, [f"line 1: version: unsupported version {obj.get('version')!r} "
                                f"(this kvbench reads version {TRACE_VERSION})"])
    try:
        return TraceHeader.model_validate(obj)
    except ValidationError as exc:
        raise TraceError(path, [f"line 1: {p}" for p in _format_validation_error(exc)]) from None


def iter_trace(path: str | Path, max_problems: int = 200) -> Iterator[TraceHeader | Trajectory]:
    """Yield the header, then each trajectory; raise one TraceError listing every problem found."""
    problems: list[str] = []
    header_seen = False
    ids: dict[str, int] = {}
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceError(path, [f"cannot read: {exc.strerror}"]) from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if not header_seen:
                header_seen = True
                yield parse_header(line, path)
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"line {number}: not JSON ({exc.msg} at column {exc.colno})")
                continue
            try:
                trajectory = Trajectory.model_validate(obj)
            except ValidationError as exc:
                problems += [f"line {number}: {p}" for p in _format_validation_error(exc)]
                continue
            refs = trajectory.check_references()
            problems += [f"line {number}: {p}" for p in refs]
            if trajectory.trajectory_id in ids:
                problems.append(f"line {number}: trajectory_id: duplicate {trajectory.trajectory_id!r} "
                                f"(first on line {ids[trajectory.trajectory_id]})")
            ids.setdefault(trajectory.trajectory_id, number)
            if len(problems) >= max_problems:
                break
            if not refs and not problems:
                yield trajectory
    if not header_seen:
        problems.append("line 1: the file is empty (expected a kvbench-trace header)")
    elif not ids and not problems:
        problems.append("the trace has a header but no trajectories")
    if problems:
        raise TraceError(path, problems)


def read_trace(path: str | Path) -> Trace:
    """Load and fully validate a trace."""
    items = list(iter_trace(path))
    header = items[0]
    assert isinstance(header, TraceHeader)
    return Trace(header=header, trajectories=[t for t in items[1:] if isinstance(t, Trajectory)])


def dump_line(model: BaseModel) -> str:
    return json.dumps(model.model_dump(mode="json", exclude_none=True), ensure_ascii=False,
                      separators=(",", ":")) + "\n"


def write_trace(path: str | Path, header: TraceHeader, trajectories: list[Trajectory]) -> int:
    """Write a trace; returns its size in bytes."""
    data = dump_line(header) + "".join(dump_line(t) for t in trajectories)
    Path(path).write_text(data, encoding="utf-8")
    return len(data.encode())
