"""When each trajectory of a run starts: its arrival offsets (the trace's own, or a process at
--qps), and a precise wait for one."""

from __future__ import annotations

import asyncio
import math
import time

from kvbench.replay.run_config import LoadSettings, ReplayError
from kvbench.tracegen.arrivals import arrival_times
from kvbench.tracegen.schema import MAX_ARRIVAL_S, Trajectory

# Trajectory tasks start this early and then wait precisely: asyncio timers are only ms-accurate.
EARLY_START_S = 0.005


def arrival_offsets(load: LoadSettings, trajectories: list[Trajectory]) -> list[float]:
    """Seconds after the first arrival at which each trajectory arrives; ReplayError when the
    last would come past what a trace allows."""
    if load.use_trace_timestamps:
        first = min((t.arrival_s for t in trajectories), default=0.0)
        return [t.arrival_s - first for t in trajectories]
    offsets = arrival_times(len(trajectories), load.qps, load.arrival, load.burstiness, seed=load.seed)  # type: ignore[arg-type]
    if offsets and not (math.isfinite(offsets[-1]) and offsets[-1] <= MAX_ARRIVAL_S):
        raise ReplayError(f"--qps {load.qps:g} schedules the last trajectory {offsets[-1]:g} s after the first, past the "
                          f"{MAX_ARRIVAL_S:g} s a trace allows: use a larger --qps (0 runs one after another)")
    return offsets


async def sleep_until(target_ns: int) -> None:
    """Sleep to within a few microseconds of `target_ns` (perf_counter), yielding to other tasks."""
    remaining = (target_ns - time.perf_counter_ns()) / 1e9
    if remaining > 0.002:
        await asyncio.sleep(remaining - 0.002)
    while time.perf_counter_ns() < target_ns:
        await asyncio.sleep(0)
