"""Export a trace to formats other tools read: Mooncake JSONL (vLLM's bench client, SGLang,
AIPerf, GuideLLM), AIPerf's DAG JSONL, and OpenAI-chat logs (what `trace import` reads back).
What each keeps and loses: docs/interop.md.

Without a run, a turn's prompt text holds a placeholder where an earlier turn's output goes, and
every turn of a trajectory carries the trajectory's arrival; with `RunTimeline` (a replayed run,
`--from-run`), the outputs that run generated fill those places and each turn is timed when that
run sent it, so tools that ignore dependencies still send each turn after its inputs existed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.tracegen.graph import topological_order
from kvbench.tracegen.schema import OUT_PREFIX, Segment, Trace, Trajectory, Turn
from kvbench.tracegen.tokenizer import TraceTokenizer

MOONCAKE_BLOCK_TOKENS = 512


def _segment_identity(trajectory: Trajectory, turn: Turn, segment: Segment) -> str:
    """Two segments with the same identity hold the same tokens (content-addressed)."""
    if segment.ph is not None:
        return f"ph:{trajectory.trajectory_id}:{segment.ph}"
    text = trajectory.agents[turn.agent].system if segment.pf == "system" else segment.text or ""
    return "pf:" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunTimeline:
    """A replayed run's timing and outputs: (trajectory, turn) -> seconds after the run's first
    request was sent, and the output token ids."""

    sent_s: dict[tuple[str, str], float]
    outputs: dict[tuple[str, str], list[int]]

    @classmethod
    def read(cls, run_dir: str | Path) -> RunTimeline:
        import pandas as pd

        path = Path(run_dir) / "requests.parquet"
        try:
            requests = pd.read_parquet(path, columns=["trajectory_id", "turn_id", "sent_ns", "output_token_ids",
                                                      "success"])
        except (OSError, ValueError) as exc:
            raise ValueError(f"--from-run: cannot read {path} ({exc})") from None
        done = requests[requests["success"].astype(bool)]
        if done.empty:
            raise ValueError(f"--from-run: {path} holds no successful request")
        origin = int(done["sent_ns"].min())
        keys = list(zip(done["trajectory_id"], done["turn_id"]))
        return cls({k: (int(t) - origin) / 1e9 for k, t in zip(keys, done["sent_ns"])},
                   {k: [int(i) for i in ids] for k, ids in zip(keys, done["output_token_ids"])})

    def when(self, trajectory: Trajectory, turn: Turn) -> float:
        return self.sent_s.get((trajectory.trajectory_id, turn.turn_id), trajectory.arrival_s)


def _when(timeline: RunTimeline | None, trajectory: Trajectory, turn: Turn) -> float:
    return timeline.when(trajectory, turn) if timeline else trajectory.arrival_s


def mooncake_records(trace: Trace, timeline: RunTimeline | None = None) -> Iterator[dict[str, Any]]:
    """One record per turn. `hash_ids` are chained per 512-token block, as in Mooncake traces: two
    turns share a block id exactly when their prompts agree up to the end of that block."""
    block_ids: dict[str, int] = {}
    for trajectory in trace.trajectories:
        for turn in trajectory.turns:
            spans: list[tuple[str, int]] = [(_segment_identity(trajectory, turn, s), trajectory.segment_tokens(s, turn))
                                            for s in turn.segments]
            total = sum(n for _, n in spans)
            hash_ids: list[int] = []
            chain = hashlib.sha256(json.dumps(trace.header.prompt_prefix_ids).encode())
            position, cursor = 0, 0
            for block_start in range(0, total, MOONCAKE_BLOCK_TOKENS):
                block_end = min(block_start + MOONCAKE_BLOCK_TOKENS, total)
                pieces = []
                while cursor < len(spans) and position < block_end:
                    identity, length = spans[cursor]
                    start = max(block_start, position)
                    stop = min(block_end, position + length)
                    pieces.append(f"{identity}[{start - position}:{stop - position}]")
                    if position + length <= block_end:
                        position += length
                        cursor += 1
                    else:
                        break
                chain = chain.copy()
                chain.update("|".join(pieces).encode())
                hash_ids.append(block_ids.setdefault(chain.hexdigest(), len(block_ids)))
            yield {
                "timestamp": round(_when(timeline, trajectory, turn) * 1000),
                "input_length": total,
                "output_length": turn.max_tokens,
                "hash_ids": hash_ids,
                "session_id": trajectory.trajectory_id,
                "agent_id": turn.agent,
                "turn_id": turn.turn_id,
                "parent": list(turn.after),
            }


def _output_text(trajectory: Trajectory, producer: str, tokenizer: TraceTokenizer,
                 timeline: RunTimeline | None) -> str:
    ids = timeline.outputs.get((trajectory.trajectory_id, producer)) if timeline else None
    if ids is None:
        return f"[the output of {producer}]"
    return tokenizer.decode(ids, skip_special_tokens=True)


def turn_messages(trajectory: Trajectory, turn: Turn, tokenizer: TraceTokenizer,
                  timeline: RunTimeline | None) -> list[dict[str, str]]:
    """The turn's prompt as chat messages: its agent's system prompt, then the rest as one user
    message (earlier outputs as the run generated them, or placeholders)."""
    parts = []
    for segment in turn.segments:
        if segment.pf == "system":
            continue
        if segment.pf == "text":
            parts.append(segment.text or "")
        elif segment.ph is not None and segment.ph.startswith(OUT_PREFIX):
            parts.append(_output_text(trajectory, segment.ph[len(OUT_PREFIX):], tokenizer, timeline))
        elif segment.ph is not None:
            parts.append(trajectory.shared[segment.ph].text)
    system = trajectory.agents[turn.agent].system
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "".join(parts)}]


def openai_chat_records(trace: Trace, tokenizer: TraceTokenizer,
                        timeline: RunTimeline | None = None) -> Iterator[dict[str, Any]]:
    """One request per turn in `trace import --format openai-chat`'s log format."""
    for trajectory in trace.trajectories:
        for turn in trajectory.turns:
            yield {"id": f"{trajectory.trajectory_id}/{turn.turn_id}", "session": trajectory.trajectory_id,
                   "agent": turn.agent, "timestamp": round(_when(timeline, trajectory, turn), 6),
                   "parent_ids": [f"{trajectory.trajectory_id}/{p}" for p in turn.after],
                   "messages": turn_messages(trajectory, turn, tokenizer, timeline),
                   "response": _output_text(trajectory, turn.turn_id, tokenizer, timeline)}


def _levels(trajectory: Trajectory) -> list[list[str]]:
    """The turns in dependency levels: each after every turn it waits for, as early as it can."""
    order = topological_order({t.turn_id: t.after for t in trajectory.turns}) or [t.turn_id for t in trajectory.turns]
    level: dict[str, int] = {}
    for turn_id in order:
        level[turn_id] = 1 + max((level[p] for p in trajectory.turn_by_id[turn_id].after), default=-1)
    levels: list[list[str]] = [[] for _ in range(1 + max(level.values(), default=0))]
    for turn_id in order:
        levels[level[turn_id]].append(turn_id)
    return levels


def aiperf_dag_records(trace: Trace, tokenizer: TraceTokenizer,
                       timeline: RunTimeline | None = None) -> Iterator[dict[str, Any]]:
    """AIPerf's DAG JSONL: per trajectory, an orchestrator whose rounds are the dependency levels
    (a round waits for all of the one before), and per turn a one-turn conversation sending its
    own complete messages (no accumulated history). AIPerf schedules the orchestrators itself."""
    for trajectory in trace.trajectories:
        prefix = trajectory.trajectory_id
        yield {"session_id": prefix, "orchestrator": True,
               "rounds": [{"spawns": [f"{prefix}/{t}" for t in level]} for level in _levels(trajectory)]}
        for turn in trajectory.turns:
            body: dict[str, Any] = {"messages": turn_messages(trajectory, turn, tokenizer, timeline),
                                    "max_tokens": turn.max_tokens,
                                    # as kvbench sends it: exactly max_tokens, unless the turn stops at EOS
                                    "extra": {"ignore_eos": not turn.stop_at_eos}}
            adapter = trajectory.agents[turn.agent].adapter
            if adapter:
                body["model"] = adapter
            yield {"session_id": f"{prefix}/{turn.turn_id}", "context_mode": "message_array_with_responses",
                   "turns": [body]}
