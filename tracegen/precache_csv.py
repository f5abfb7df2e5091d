"""`kvbench trace import --format precache-csv`: PReCache's controlled trajectories (its
`traces/*.csv`: one row per turn, `agent,prefill_len,decode_len`).

PReCache replays a trajectory as one growing token stream: turn k's prompt is every earlier
turn's prompt and output plus its own `prefill_len` new tokens, under its agent's LoRA adapter,
and it generates `decode_len` tokens. In a kvbench trace: turn k reads shared segments `p0..pk`
(the new tokens of each turn, filler text of exactly that many tokens) and every earlier turn's
output, in stream order, after the turn before it. Agents name no system prompt; each agent is
the adapter of its name when `--adapter AGENT=PATH` gives one. `repeats` trajectories (PReCache's
laps) differ in their filler.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from kvbench import __version__
from kvbench.tracegen.generate import TokenCounter, shared_context
from kvbench.tracegen.schema import (
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
)
from kvbench.tracegen.tokenizer import TraceTokenizer

COLUMNS = ("agent", "prefill_len", "decode_len")
LOG = "precache-csv trace"


def read_precache_csv(path: str | Path) -> list[tuple[str, int, int]]:
    """The rows (agent, prefill tokens, decode tokens); TraceError naming every bad one."""
    problems: list[str] = []
    rows: list[tuple[str, int, int]] = []
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(path, [f"line 1: header: no column {', '.join(missing)} (needs {', '.join(COLUMNS)})"],
                                 LOG)
            for number, row in enumerate(reader, start=2):
                agent = (row.get("agent") or "").strip()
                if not agent or not agent.isprintable():
                    problems.append(f"line {number}: agent: must be non-empty printable text")
                lengths = []
                for column in COLUMNS[1:]:
                    try:
                        value = int(row.get(column) or "")
                    except ValueError:
                        value = 0
                    if value < 1:
                        problems.append(f"line {number}: {column}: must be a whole number of tokens >= 1, "
                                        f"got {row.get(column)!r}")
                    lengths.append(value)
                rows.append((agent, lengths[0], lengths[1]))
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, [f"cannot read it: {exc}"], LOG) from None
    if not rows and not problems:
        problems.append("no turns")
    if problems:
        raise TraceError(path, problems, LOG)
    return rows


def precache_trace(rows: list[tuple[str, int, int]], tokenizer: TraceTokenizer, repeats: int = 1, seed: int = 0,
                   source: str = "") -> tuple[TraceHeader, list[Trajectory]]:
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
