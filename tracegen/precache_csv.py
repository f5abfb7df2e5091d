"""`kvbench trace import --format precache-csv`: PReCache's controlled trajectories (its
`traces/*.csv`: one row per turn, `agent,prefill_len,decode_len`).

PReCache replays a trajectory as one growing token stream: turn k's prompt is every earlier
turn's prompt and output plus its own `prefill_len` new tokens, under its agent's LoRA adapter,
and it generates `decode_len` tokens. In a kvbench trace: turn k reads shared segments `p0..pk`
(the new tokens of each turn, filler text of exactly that many tokens) and every earlier turn's
output, in stream order, after the turn before it. Agents name no system prompt; each agent is
the adapter of its name when `--adapter AGENT=PATH` gives one. `repeats` trajectories (PReCache's
laps) differ in their filler.

Read within a trace's bounds before anything is expanded: a regular file, lines under the trace
line limit, each count under the trace format's caps, and a trajectory (every turn's filler and
its growing list of segments) that fits one trace line, estimated before any filler is made.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path
from typing import Any

from kvbench import __version__
from kvbench.tracegen.generate import TokenCounter, shared_context
from kvbench.tracegen.schema import (
    MAX_OUTPUT_TOKENS,
    MAX_SEGMENT_TOKENS,
    OUT_PREFIX,
    TRACE_FORMAT,
    TRACE_VERSION,
    Agent,
    Segment,
    SharedText,
    TraceError,
    TraceHeader,
    Trajectory,
    Turn,
    max_line_bytes,
    max_text_bytes,
)
from kvbench.tracegen.tokenizer import TraceTokenizer
from kvbench.tracegen.trace_files import readable_lines

COLUMNS = ("agent", "prefill_len", "decode_len")
LOG = "precache-csv trace"
CAPS = {"prefill_len": MAX_SEGMENT_TOKENS, "decode_len": MAX_OUTPUT_TOKENS}
SEGMENT_JSON_BYTES = 24  # a segment reference in a trace line ({"ph":"p12"},), about


def _csv_lines(path: str | Path, problems: list[str]) -> list[str]:
    """The file's lines, read as a trace is: a regular file, each line under the limit, UTF-8."""
    lines: list[str] = []
    for number, text in readable_lines(path, LOG, problems):
        lines += [""] * (number - 1 - len(lines)) + [text]  # a blank for each line refused: numbers kept
    return lines


def _count(row: dict[str, Any], column: str, number: int, problems: list[str]) -> int:
    raw = (row.get(column) or "").strip()
    value = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 12 else 0  # never a 10^4300 int
    if not 1 <= value <= CAPS[column]:
        problems.append(f"line {number}: {column}: must be a whole number of tokens from 1 to {CAPS[column]}, "
                        f"got {raw[:40]!r}")
    return value


def read_precache_csv(path: str | Path) -> list[tuple[str, int, int]]:
    """The rows (agent, prefill tokens, decode tokens); TraceError naming every bad one."""
    problems: list[str] = []
    rows: list[tuple[str, int, int]] = []
    lines = _csv_lines(path, problems)
    csv.field_size_limit(max_line_bytes())
    try:
        reader = csv.DictReader(lines)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(path, [f"line 1: header: no column {', '.join(missing)} (needs {', '.join(COLUMNS)})"], LOG)
        for row in reader:
            number = reader.line_num
            agent = (row.get("agent") or "").strip()
            if not agent or not agent.isprintable():
                problems.append(f"line {number}: agent: must be non-empty printable text")
            rows.append((agent, _count(row, "prefill_len", number, problems), _count(row, "decode_len", number, problems)))
            if len(problems) >= 200:
                break
    except csv.Error as exc:
        problems.append(f"line {reader.line_num}: not CSV ({exc})")
    if not rows and not problems:
        problems.append("no turns")
    if problems:
        raise TraceError(path, problems, LOG)
    return rows


def _line_estimate(rows: list[tuple[str, int, int]], bytes_per_token: float) -> float:
    """About how many bytes a trajectory line of these turns takes: its filler text and, per
    turn k, the k + 1 segments it reads and the k outputs before them."""
    turns = len(rows)
    return bytes_per_token * sum(prefill for _, prefill, _ in rows) + SEGMENT_JSON_BYTES * turns * turns


def check_size(rows: list[tuple[str, int, int]], tokenizer: TraceTokenizer, path: str | Path = "<csv>") -> None:
    """Refuse, before any filler is made, turns whose trajectory cannot be one trace line, or a
    turn whose filler cannot be one trace text."""
    counter = TokenCounter(tokenizer)
    sample = shared_context(counter, random.Random(0), 512)
    bytes_per_token = len(sample.encode()) / 512
    problems = [f"line {number}: prefill_len: {prefill} tokens of filler take about "
                f"{prefill * bytes_per_token / 2**20:.1f} MiB, over the trace text limit of {max_text_bytes() / 2**20:.1f} "
                "MiB (KVBENCH_MAX_TRACE_TEXT_BYTES raises it)"
                for number, (_, prefill, _) in enumerate(rows, start=2) if prefill * bytes_per_token > max_text_bytes()]
    if (size := _line_estimate(rows, bytes_per_token)) > max_line_bytes():
        problems.append(f"a trajectory of these {len(rows)} turns ({sum(p for _, p, _ in rows)} prefill tokens) "
                        f"takes about {size / 2**20:.1f} MiB, over the trace line limit of "
                        f"{max_line_bytes() / 2**20:.1f} MiB (KVBENCH_MAX_TRACE_LINE_BYTES raises it)")
    if problems:
        raise TraceError(path, problems, LOG)


def precache_trace(rows: list[tuple[str, int, int]], tokenizer: TraceTokenizer, repeats: int = 1, seed: int = 0,
                   source: str = "") -> tuple[TraceHeader, list[Trajectory]]:
    check_size(rows, tokenizer, source or "<csv>")
    counter = TokenCounter(tokenizer)
    agents = {name: Agent(role=name, system="", system_tokens=0) for name, _, _ in rows}
    trajectories = []
    for lap in range(repeats):
        rng = random.Random(seed * 1000 + lap)
        shared = {f"p{k}": SharedText(text=shared_context(counter, rng, prefill), num_tokens=prefill)
                  for k, (_, prefill, _) in enumerate(rows)}
        turns, stream = [], []
        for k, (agent, _, decode) in enumerate(rows):
            stream.append(Segment(ph=f"p{k}"))
            turn_id = f"{agent}.r{k}"
            turns.append(Turn(turn_id=turn_id, agent=agent, after=[turns[-1].turn_id] if turns else [],
                              max_tokens=decode, segments=list(stream)))
            stream.append(Segment(ph=OUT_PREFIX + turn_id))
        trajectories.append(Trajectory(trajectory_id=f"t{lap:06d}", arrival_s=0.0, agents=agents, shared=shared,
                                       turns=turns))
    header = TraceHeader(format=TRACE_FORMAT, version=TRACE_VERSION,
                         generator={"name": "kvbench trace import", "format": "precache-csv", "source": source,
                                    "repeats": repeats, "seed": seed, "kvbench_version": __version__},
                         tokenizer=tokenizer.name, tokenizer_sha256=tokenizer.sha256,
                         prompt_prefix_ids=tokenizer.prompt_prefix_ids)
    return header, trajectories
