"""Arrival schedules of trajectories (shared by gen-trace and replay, as in `vllm bench serve`)."""

from __future__ import annotations

from typing import Literal

import numpy as np

ArrivalProcess = Literal["poisson", "gamma", "constant"]
ARRIVAL_PROCESSES: tuple[str, ...] = ("poisson", "gamma", "constant")


def arrival_times(n: int, qps: float, process: ArrivalProcess = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Absolute arrival offsets (s) of `n` trajectories, the first at 0.

    `qps` 0 means single stream: everything "arrives" at 0 and the replayer runs trajectories
    one at a time. Gamma gaps have shape `burstiness` (1 = Poisson; < 1 burstier, > 1 smoother;
    coefficient of variation 1/sqrt(burstiness)). As vLLM does, the schedule is rescaled so the
    last arrival lands exactly at (n-1)/qps, which removes seed-to-seed spread in the mean rate.
    """
    if n < 0:
        raise ValueError("the number of arrivals must be >= 0")
    if qps < 0:
        raise ValueError(f"qps must be >= 0, got {qps}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"unknown arrival process {process!r}; choose from {', '.join(ARRIVAL_PROCESSES)}")
    if n == 0:
        return []
    if qps == 0:
        return [0.0] * n
    if process == "constant" or n == 1:
        return [i / qps for i in range(n)]
    shape = 1.0 if process == "poisson" else burstiness
    gaps = np.random.default_rng(seed).gamma(shape=shape, scale=1.0 / (qps * shape), size=n - 1)
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    times *= ((n - 1) / qps) / times[-1]
    return [round(float(t), 6) for t in times]
