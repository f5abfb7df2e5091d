"""The report's reuse-turn table: ratios against NonShared's same turns, with intervals over
trajectories, computed from runs made up here with known TTFTs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.analysis.runs import Run
from kvbench.analysis.savings import reuse_turn_savings

GENERATOR = {"shared_tokens": 8192, "num_agents": 2, "rounds": 1, "seed": 0}


def _run(method: str, first_ms: float, reuse_ms: float, trajectories: int = 6, model: str = "m") -> Run:
    rows = []
    for t in range(trajectories):
        jitter = 1 + 0.01 * t
        rows.append({"trajectory_id": f"t{t}", "turn_id": "A0.r0", "success": True, "reusable_tokens": 0,
                     "ttft_ms": first_ms * jitter})
        rows.append({"trajectory_id": f"t{t}", "turn_id": "A1.r0", "success": True, "reusable_tokens": 8000,
                     "ttft_ms": reuse_ms * jitter})
    summary = {"method": method, "request_rate": 0.0,
               "config": {"model": model, "trace_header": {"generator": GENERATOR}}}
    return Run(Path(method), summary, pd.DataFrame(rows))


def test_reuse_turns_are_compared_with_nonshareds_same_turns() -> None:
    table = reuse_turn_savings([_run("nonshared", 500, 520), _run("fullshared", 510, 150), _run("kvcmas", 520, 208)])
    rows = table.set_index("run")
    assert list(rows.index) == ["fullshared ctx=8192 a=2 r=1 qps=0", "kvcmas ctx=8192 a=2 r=1 qps=0"]
    kvcmas = rows.loc["kvcmas ctx=8192 a=2 r=1 qps=0"]
    assert kvcmas["reuse_turns"] == 6 and kvcmas["p50_reuse_ttft_ms"] == 208 * 1.025
    assert kvcmas["reuse_vs_nonshared"].startswith("0.40 [")  # 208 / 520, paired trajectories: a tight interval
    assert kvcmas["reuse_vs_fullshared"].startswith("1.39 [")  # 208 / 150
    assert kvcmas["first_vs_nonshared"].startswith("1.04 [")
    assert rows.loc["fullshared ctx=8192 a=2 r=1 qps=0", "reuse_vs_fullshared"] == ""


def test_no_nonshared_run_or_another_model_gives_no_row() -> None:
    assert reuse_turn_savings([_run("fullshared", 500, 150), _run("kvcmas", 500, 200)]).empty
    assert reuse_turn_savings([_run("nonshared", 500, 520), _run("kvcmas", 500, 200, model="other")]).empty
    one = reuse_turn_savings([_run("nonshared", 500, 520, trajectories=1), _run("kvcmas", 500, 200, trajectories=1)])
    assert one.iloc[0]["reuse_vs_nonshared"] == "n/a (fewer than 2 trajectories)"
