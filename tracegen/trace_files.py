"""Reading and writing trace files (the format is tracegen/schema.py's): line by line, with every
problem reported by line and field, bounded line and text sizes, and repeated keys refused."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kvbench.tracegen.schema import (
    MAX_LINE_BYTES_ENV,
    READABLE_VERSIONS,
    TRACE_FORMAT,
    Trace,
    TraceError,
    TraceHeader,
    Trajectory,
    max_line_bytes,
    max_text_bytes,
    reference_problems,
)


def _format_validation_error(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors():
        field = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in item["loc"]).replace(".[", "[")
        problems.append(f"{field or '(line)'}: {item['msg']}")
    return problems


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's keys, refusing a repeated one (json.loads would keep the last silently)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def load_json_line(line: str) -> tuple[Any, str | None]:
    """The parsed line, or None and why it is not JSON this reader accepts (a key given twice,
    nesting too deep, an integer of more digits than Python converts): one line, never a traceback."""
    try:
        return json.loads(line, object_pairs_hook=_unique_keys), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at column {exc.colno})"
    except _DuplicateKey as exc:
        return None, f"duplicate key {exc.args[0]!r} in one object (JSON readers disagree on which wins)"
    except RecursionError:
        return None, "not JSON this reader accepts (nested too deeply)"
    except ValueError as exc:
        return None, f"not JSON this reader accepts ({exc})"


def parse_header(line: str, path: str | Path = "<trace>") -> TraceHeader:
    obj, error = load_json_line(line)
    if error is not None:
        raise TraceError(path, [f"line 1: {error}"])
    if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
        raise TraceError(path, [f"line 1: format: expected a header with \"format\": \"{TRACE_FORMAT}\""])
    if obj.get("version") not in READABLE_VERSIONS:
        raise TraceError(path, [f"line 1: version: unsupported version {obj.get('version')!r} "
                                f"(this kvbench reads versions {', '.join(map(str, READABLE_VERSIONS))})"])
    if obj.get("version") == 1 and obj.get("adapters"):
        raise TraceError(path, ["line 1: adapters: a version 1 trace has no adapters (write version 2)"])
    try:
        return TraceHeader.model_validate(obj)
    except ValidationError as exc:
        raise TraceError(path, [f"line 1: {p}" for p in _format_validation_error(exc)]) from None


class LineTooLong(str):
    """Stands for a line longer than the limit (never read into memory whole)."""


def open_regular(path: str | Path, what: str = "trace", expected: str = "a JSONL file") -> Any:
    """The file opened for binary reading; TraceError unless it is a regular file. A device or
    FIFO (/dev/zero, a pipe) may never end, and opening a FIFO waits for a writer."""
    try:
        mode = os.stat(path).st_mode  # before opening
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a device, FIFO or socket"
            raise TraceError(path, [f"not a regular file ({kind}): {expected} is expected"], what)
        return open(path, "rb")
    except OSError as exc:
        raise TraceError(path, [f"cannot read: {exc.strerror}"], what) from None


def bounded_lines(path: str | Path, what: str = "trace") -> Iterator[tuple[int, str | None]]:
    """(line number, text) of each line, split at "\n" only (U+2028 and the like are text); text
    None for a line that is not UTF-8, a `LineTooLong` for one longer than `max_line_bytes()`
    (skipped in chunks). Only regular files are read (`open_regular`)."""
    handle = open_regular(path, what)
    with handle:
        try:
            limit = max_line_bytes()
            max_text_bytes()  # a bad setting is named once here, not on every text
        except ValueError as exc:
            raise TraceError(path, [str(exc)], what) from None
        number = 0
        while raw := handle.readline(limit + 1):
            number += 1
            if len(raw) > limit and not raw.endswith(b"\n"):
                while (rest := handle.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass
                yield number, LineTooLong()
                continue
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield number, None


def readable_lines(path: str | Path, what: str, problems: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line `bounded_lines` could read; a line over the limit or not
    UTF-8 becomes a problem by its number instead (an importer's reading, as a trace's)."""
    for number, text in bounded_lines(path, what):
        if isinstance(text, LineTooLong):
            problems.append(f"line {number}: longer than the trace line limit ({MAX_LINE_BYTES_ENV} raises it)")
        elif text is None:
            problems.append(f"line {number}: not UTF-8 text")
        else:
            yield number, text


def iter_trace(path: str | Path, max_problems: int = 200) -> Iterator[tuple[int, TraceHeader | Trajectory]]:
    """Yield (line, header), then (line, trajectory) for each; raise one TraceError listing every
    problem found (up to `max_problems`)."""
    problems: list[str] = []
    header_seen = False
    adapters: set[str] = set()
    ids: dict[str, int] = {}
    for number, line in bounded_lines(path):
        if isinstance(line, LineTooLong):
            problem = (f"line {number}: longer than {max_line_bytes()} bytes ({MAX_LINE_BYTES_ENV} raises the limit)")
            if not header_seen:
                raise TraceError(path, [problem])
            problems.append(problem)
            continue
        if line is None:
            if not header_seen:
                raise TraceError(path, [f"line {number}: not UTF-8 text (is this a kvbench trace?)"])
            problems.append(f"line {number}: not UTF-8 text")
            continue
        if not line.strip():
            continue
        if not header_seen:
            header_seen = True
            header = parse_header(line, path)
            adapters = set(header.adapters or {})
            yield number, header
            continue
        obj, error = load_json_line(line)
        if error is not None:
            problems.append(f"line {number}: {error}")
            continue
        line_problems = [f"line {number}: {p}" for p in reference_problems(obj) + _adapter_problems(obj, adapters)]
        trajectory = None
        try:
            trajectory = Trajectory.model_validate(obj)
        except ValidationError as exc:
            line_problems = [f"line {number}: {p}" for p in _format_validation_error(exc)] + line_problems
        except RecursionError:
            line_problems.append(f"line {number}: nested too deeply")
        problems += line_problems
        tid = obj.get("trajectory_id") if isinstance(obj, dict) else None
        if isinstance(tid, str):
            if tid in ids:
                problems.append(f"line {number}: trajectory_id: duplicate {tid!r} (first on line {ids[tid]})")
            ids.setdefault(tid, number)
        if len(problems) >= max_problems:
            break
        if trajectory is not None and not problems:
            yield number, trajectory
    if not header_seen:
        problems.append("line 1: the file is empty (expected a kvbench-trace header)")
    elif not ids and not problems:
        problems.append("line 2: the trace has a header but no trajectories (one per line after it)")
    if problems:
        raise TraceError(path, problems)


def _adapter_problems(obj: Any, adapters: set[str]) -> list[str]:
    """Agents naming an adapter the header does not list."""
    agents = obj.get("agents") if isinstance(obj, dict) and isinstance(obj.get("agents"), dict) else {}
    return [f"agents.{name}.adapter: unknown adapter {agent['adapter']!r} (the header lists "
            f"{', '.join(sorted(adapters)) or 'none'})"
            for name, agent in agents.items()
            if isinstance(agent, dict) and isinstance(agent.get("adapter"), str) and agent["adapter"] not in adapters]


def read_trace(path: str | Path) -> Trace:
    """Load and fully validate a trace's structure (token counts: `tracegen.validate`)."""
    items = list(iter_trace(path))
    _, header = items[0]
    assert isinstance(header, TraceHeader)
    trajectories = [(n, t) for n, t in items[1:] if isinstance(t, Trajectory)]
    return Trace(header=header, trajectories=[t for _, t in trajectories], line_numbers=[n for n, _ in trajectories])


def dump_line(model: BaseModel) -> str:
    return json.dumps(model.model_dump(mode="json", exclude_none=True), ensure_ascii=False,
                      separators=(",", ":")) + "\n"


def trajectory_digest(trajectory: Trajectory) -> str:
    """What identifies a trajectory's content across runs (its id alone repeats across traces)."""
    # surrogatepass: a trace's text may hold lone surrogates (valid JSON escapes), which replay as is
    return hashlib.sha256(dump_line(trajectory).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def write_trace(path: str | Path, header: TraceHeader, trajectories: list[Trajectory]) -> int:
    """Write a trace (its folder made when missing); returns its size in bytes."""
    data = dump_line(header) + "".join(dump_line(t) for t in trajectories)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(data, encoding="utf-8")
    return len(data.encode())
