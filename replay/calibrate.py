"""Find the gate threshold (tau, or KVComm's gamma) that reaches a target reuse ratio rho on a
calibration trace: bisection over replays on one server, the method's state reset each time."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tokenizer import TraceTokenizer


@dataclass
class CalibrationStep:
    threshold: float
    realized_rho: float


def calibrate_threshold(trace: Trace, tokenizer: TraceTokenizer, method: str, base_url: str, target_rho: float,
                        threshold_name: str, iterations: int = 6,
                        on_step: Callable[[CalibrationStep], None] | None = None) -> list[CalibrationStep]:
    """Realized rho grows with the threshold (a looser gate accepts more), so bisect on [0, 1]."""
    from kvbench.replay.runner import ReplayConfig, run_replay
    from kvbench.replay.server import collective_rpc

    def rho_at(threshold: float) -> float:
        collective_rpc(base_url, "kvbench_set_params", params=json.dumps({threshold_name: threshold}))
        with tempfile.TemporaryDirectory() as tmp:
            summary = run_replay(ReplayConfig(trace=trace, tokenizer=tokenizer, method=method, base_urls=[base_url],
                                              result_dir=Path(tmp) / "run", qps=0, show_progress=False))
        rho = summary.get("realized_rho")
        return float(rho) if rho is not None else 0.0

    steps: list[CalibrationStep] = []
    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = (low + high) / 2
        step = CalibrationStep(middle, rho_at(middle))
        steps.append(step)
        if on_step is not None:
            on_step(step)
        if step.realized_rho < target_rho:
            low = middle
        else:
            high = middle
    return steps


def best_step(steps: list[CalibrationStep], target_rho: float) -> CalibrationStep:
    return min(steps, key=lambda s: (abs(s.realized_rho - target_rho), s.threshold))


def summary_dict(steps: list[CalibrationStep], target_rho: float, threshold_name: str) -> dict[str, Any]:
    best = best_step(steps, target_rho)
    return {"target_rho": target_rho, threshold_name: best.threshold, "realized_rho": best.realized_rho,
            "steps": [{threshold_name: s.threshold, "realized_rho": s.realized_rho} for s in steps]}
