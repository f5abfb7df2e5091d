"""Export a trace to formats other replay tools read (Mooncake JSONL: vLLM, SGLang, AIPerf, GuideLLM)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

from kvbench.tracegen.schema import Segment, Trace, Trajectory, Turn

MOONCAKE_BLOCK_TOKENS = 512


def _segment_identity(trajectory: Trajectory, turn: Turn, segment: Segment) -> str:
    """Two segments with the same identity hold the same tokens (content-addressed)."""
    if segment.ph is not None:
        return f"ph:{trajectory.trajectory_id}:{segment.ph}"
    text = trajectory.agents[turn.agent].system if segment.pf == "system" else segment.text or ""
    return "pf:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def mooncake_records(trace: Trace) -> Iterator[dict[str, Any]]:
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
                "timestamp": round(trajectory.arrival_s * 1000),
                "input_length": total,
                "output_length": turn.max_tokens,
                "hash_ids": hash_ids,
                "session_id": trajectory.trajectory_id,
                "agent_id": turn.agent,
                "turn_id": turn.turn_id,
                "parent": list(turn.after),
            }
