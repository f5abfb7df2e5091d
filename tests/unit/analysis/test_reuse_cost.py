"""The report's reuse-cost table: per-turn scores of reuse turns against the reference, means with
intervals over whole trajectories, computed from run folders made up here with known scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench import run_files
from kvbench.analysis.intervals import cluster_mean_interval
from kvbench.analysis.reuse_cost import reuse_turn_costs
from kvbench.analysis.runs import Run

GENERATOR = {"shared_tokens": 2048, "num_agents": 3, "rounds": 1, "seed": 0}


def _run(folder: Path, method: str, wrong_in: set[int], trajectories: int = 8) -> Run:
    """Each trajectory: a first turn and two reuse turns; the reuse turns of trajectories in
    `wrong_in` differ from the reference from token 3 on and answer wrong."""
    folder.mkdir()
    quality, scores = [], []
    for t in range(trajectories):
        for turn, reuse in (("A0.r0", False), ("A1.r0", True), ("A2.r0", True)):
            wrong = reuse and t in wrong_in
            quality.append({"trajectory_id": f"t{t}", "turn_id": turn, "reuse_turn": reuse, "success": True,
                            "exact_match": not wrong, "first_divergence": 3 if wrong else 12,
                            "token_f1": 0.5 if wrong else 1.0, "first_token_kl": 0.2 if wrong else 0.0})
            scores.append({"trajectory_id": f"t{t}", "turn_id": turn, "reuse_turn": reuse, "correct": not wrong})
    pd.DataFrame(quality).to_parquet(folder / run_files.QUALITY)
    pd.DataFrame(scores).to_parquet(folder / run_files.TASK_SCORES)
    summary = {"method": method, "request_rate": 0.0, "config": {"model": "m", "trace_header": {"generator": GENERATOR}}}
    return Run(folder, summary, pd.DataFrame({"trajectory_id": [], "success": []}))


def test_reuse_turns_scores_with_intervals_over_trajectories(tmp_path: Path) -> None:
    table = reuse_turn_costs([_run(tmp_path / "ns", "nonshared", set()),
                              _run(tmp_path / "fs", "fullshared", {0, 1, 2, 3})]).set_index("run")
    nonshared, fullshared = table.loc["nonshared ctx=2048 a=3 r=1 qps=0"], table.loc["fullshared ctx=2048 a=3 r=1 qps=0"]
    assert nonshared["reuse_turns"] == 16 and nonshared["exact_match_reuse"] == "1.00 [1.00, 1.00]"
    assert nonshared["diverged_reuse_turns"] == 0 and np.isnan(nonshared["p50_first_divergence"])
    # half the trajectories wrong on both reuse turns: 0.5, and the first turns left out
    assert fullshared["task_accuracy_reuse"].startswith("0.50 [") and fullshared["exact_match_reuse"].startswith("0.50 [")
    assert fullshared["token_f1_reuse"].startswith("0.75 [") and fullshared["first_token_kl_reuse"].startswith("0.100 [")
    assert fullshared["diverged_reuse_turns"] == 8 and fullshared["p50_first_divergence"] == 3
    low, high = (float(x) for x in fullshared["exact_match_reuse"][6:-1].split(", "))
    assert 0.1 < low < 0.5 < high < 0.9  # eight trajectories: a wide interval, not a turn-level one


def test_cluster_interval_resamples_trajectories_not_turns() -> None:
    # two trajectories of 50 turns each, one all right and one all wrong: the trajectory is the unit
    values = pd.Series([1.0] * 50 + [0.0] * 50)
    trajectories = pd.Series(["a"] * 50 + ["b"] * 50)
    low, high = cluster_mean_interval(values, trajectories)
    assert low == 0.0 and high == 1.0  # a turn-level bootstrap would give about [0.4, 0.6]
    assert cluster_mean_interval(pd.Series([np.nan]), pd.Series(["a"])) == (pytest.approx(np.nan, nan_ok=True),) * 2


def test_runs_without_quality_or_scores_give_no_row(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    summary = {"method": "kvcmas", "request_rate": 0.0, "config": {"model": "m", "trace_header": {"generator": GENERATOR}}}
    assert reuse_turn_costs([Run(folder, summary, pd.DataFrame())]).empty
