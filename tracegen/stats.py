"""Descriptive statistics of a trace: sizes, prompt lengths, and how much could be reused."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from kvbench.tracegen.schema import Trace


def trace_stats(trace: Trace, percentiles: tuple[float, ...] = (50, 90, 99)) -> dict[str, Any]:
    """Shared tokens per workflow edge and the theoretical maximum reuse fraction per agent.

    The reusable part of a prompt is every PH token some earlier turn's cache already holds
    (`Trajectory.source_of`); PF tokens and first-seen PH tokens must be prefilled by any method.
    An edge's shared tokens are those the target reuses from that source's cache: each segment
    counted once, on the edge a method reuses it through (a fan-in agent reads the context once,
    from its latest predecessor, not once per predecessor holding it). Segments that only a turn
    running at the same time holds (agents reading one document in parallel) are counted apart:
    they are reusable once that turn's prompt is computed (`kvbench replay`'s concurrent sources).
    """
    prompt_lengths: list[int] = []
    edge_shared: dict[str, list[int]] = defaultdict(list)
    concurrent_shared: dict[str, list[int]] = defaultdict(list)  # "A0->A1": tokens read from a turn running alongside
    total_concurrent = 0
    agent_prompt: dict[str, int] = defaultdict(int)
    agent_reusable: dict[str, int] = defaultdict(int)
    agent_turns: dict[str, int] = defaultdict(int)
    total_shared = total_reusable = 0
    for trajectory in trace.trajectories:
        for turn in trajectory.turns:
            prompt = trajectory.prompt_tokens(turn)
            prompt_lengths.append(prompt)
            reusable = 0
            by_source: dict[str, int] = defaultdict(int)  # each PH segment once, from the cache reused for it
            for segment in turn.segments:
                if segment.ph is None:
                    continue
                tokens = trajectory.segment_tokens(segment, turn)
                total_shared += tokens
                source = trajectory.source_of(turn, segment.ph)
                if source is not None:
                    reusable += tokens
                    by_source[source] += tokens
                elif holders := trajectory.concurrent_holders(turn, segment.ph):
                    # no predecessor holds it, a turn running alongside does (read once its prompt is computed)
                    total_concurrent += tokens
                    concurrent_shared[f"{trajectory.turn_by_id[holders[0]].agent}->{turn.agent}"].append(tokens)
            for source in sorted(set(turn.after) | set(by_source)):
                edge_shared[f"{trajectory.turn_by_id[source].agent}->{turn.agent}"].append(by_source.get(source, 0))
            total_reusable += reusable
            agent_prompt[turn.agent] += prompt
            agent_reusable[turn.agent] += reusable
            agent_turns[turn.agent] += 1
    lengths = np.asarray(prompt_lengths)
    return {
        "trajectories": len(trace.trajectories),
        "turns": len(prompt_lengths),
        "prompt_tokens": {"mean": float(lengths.mean()), "max": int(lengths.max()),
                          **{f"p{p:g}": float(np.percentile(lengths, p)) for p in percentiles}},
        "shared_tokens_per_edge": {edge: float(np.mean(v)) for edge, v in sorted(edge_shared.items())},
        "max_reuse_fraction_per_agent": {agent: agent_reusable[agent] / agent_prompt[agent]
                                         for agent in sorted(agent_prompt)},
        "turns_per_agent": dict(sorted(agent_turns.items())),
        "max_reuse_fraction": total_reusable / max(1, int(lengths.sum())),
        "reusable_fraction_of_shared": total_reusable / max(1, total_shared),
        # Shared segments no predecessor holds but a concurrent turn's prompt does (the earliest
        # such turn in trace order: the one kvbench replay reads them from, once it was sent).
        "concurrent_shared_tokens_per_edge": {edge: float(np.mean(v)) for edge, v in sorted(concurrent_shared.items())},
        "concurrent_reusable_fraction_of_shared": total_concurrent / max(1, total_shared),
    }
