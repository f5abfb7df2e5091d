"""Figures checked against values computed here by hand from known inputs, never through the
code under test: task PGR from known task scores, the paper figure's p90 from the summary's own
key, and compare's gates in both directions for every key where higher is better."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from paths import ROOT

from kvbench import run_files
from kvbench.analysis.quality import write_quality
from kvbench.analysis.runs import Run

TRAJECTORIES = [f"t{i}" for i in range(10)]


def _run(folder: Path, right: int, outputs_match: bool = True) -> Path:
    """A run of ten one-turn trajectories whose first `right` final answers are right."""
    folder.mkdir(parents=True)
    records = [{"trajectory_id": t, "turn_id": "A0", "agent": "A0", "success": True, "reusable_tokens": 0,
                "request_id": f"{folder.name}/{t}", "output_token_ids": [1, 2, 3] if outputs_match else [4]}
               for t in TRAJECTORIES]
    run_files.write_requests_parquet(records, folder / run_files.REQUESTS)
    pd.DataFrame({"trajectory_id": TRAJECTORIES, "turn_id": "A0", "final": True,
                  "correct": [i < right for i in range(10)]}).to_parquet(folder / run_files.TASK_SCORES)
    return folder


def test_task_pgr_from_known_scores(tmp_path: Path) -> None:
    oracle, floor = _run(tmp_path / "reference", right=9), _run(tmp_path / "floor", right=2, outputs_match=False)
    method, naive = _run(tmp_path / "method", right=7), _run(tmp_path / "naive", right=4)
    write_quality(method, oracle, floor, naive)
    figures = json.loads((method / run_files.QUALITY_PGR).read_text())
    assert figures["pgr_oracle_score"] == pytest.approx(0.9) and figures["pgr_floor_score"] == pytest.approx(0.2)
    assert figures["pgr"] == pytest.approx((0.7 - 0.2) / (0.9 - 0.2))
    assert figures["pgr_naive"] == pytest.approx((0.4 - 0.2) / (0.9 - 0.2))
    assert figures["pgr_gain_over_naive"] == pytest.approx((0.7 - 0.4) / (0.9 - 0.2))
    assert figures["pgr_low"] <= figures["pgr"] <= figures["pgr_high"]
    # over outputs: the method's tokens are the reference's, the floor's share none of them
    assert figures["output_pgr"] == pytest.approx(1.0) and figures["output_pgr_floor_score"] == pytest.approx(0.0)


def test_task_pgr_is_undefined_when_the_context_does_not_move_the_score(tmp_path: Path) -> None:
    oracle, floor, method = (_run(tmp_path / n, right=5) for n in ("reference", "floor", "method"))
    write_quality(method, oracle, floor)
    figures = json.loads((method / run_files.QUALITY_PGR).read_text())
    assert figures["pgr"] is None and "not above the floor" in figures["pgr_reason"]
    assert not math.isnan(figures["pgr_floor_score"])


def _summary_run(method: str, path: Path | None = None, **figures: float) -> Run:
    summary = {"method": method, "label": method, "request_rate": 0.0, "config": {}, **figures}
    return Run(path or Path(method), summary, pd.DataFrame(columns=["trajectory_id", "ttft_ms", "success"]))


def test_the_paper_figures_p90_is_the_summarys_own_p90() -> None:
    from kvbench.analysis.aggregate import run_row

    requests = pd.DataFrame({"trajectory_id": ["t0", "t1", "t2"], "ttft_ms": [100.0, 200.0, 600.0],
                             "success": [True, True, True], "reusable_tokens": [0, 10, 10]})
    run = Run(Path("r"), {"method": "kvcmas", "p50_ttft_ms": 200.0, "p90_ttft_ms": 520.0, "config": {}}, requests)
    row = run_row(run)
    assert row["p50_ttft_s"] == pytest.approx(0.2) and row["p90_ttft_s"] == pytest.approx(0.52)
    assert row["mean_ttft_s"] == pytest.approx(0.3) and row["reuse_ttft_s"] == pytest.approx(0.4)


# Written out here, not taken from compare.py: what a reader of the summary means by "better".
HIGHER_IS_BETTER = ["request_throughput", "output_throughput", "total_token_throughput",
                    "mean_trajectory_token_throughput", "completed", "completed_trajectories", "realized_rho",
                    "eligible_rho", "pgr", "output_pgr", "exact_match_rate", "exact_match_rate_reuse", "mean_token_f1",
                    "top1_agreement", "task_accuracy", "task_accuracy_reuse", "task_accuracy_first",
                    "mean_first_divergence"]
LOWER_IS_BETTER = ["p50_ttft_ms", "p90_ttft_ms", "mean_e2el_ms", "p50_trajectory_ttft_ms", "failed",
                   "mean_first_token_kl", "peak_server_rss_bytes", "method_store_peak_bytes"]


@pytest.mark.parametrize("metric", HIGHER_IS_BETTER + LOWER_IS_BETTER)
def test_every_gate_fails_a_change_for_the_worse_and_passes_one_for_the_better(metric: str) -> None:
    from kvbench.analysis.compare import Gate, evaluate_gates, failed

    higher = metric in HIGHER_IS_BETTER
    for gate in (Gate.parse(f"{metric}=+10%"), Gate.parse(f"{metric}=-0.1")):
        baseline = [_summary_run("kvcmas", **{metric: 0.6})]
        worse = [_summary_run("kvcmas", **{metric: 0.4 if higher else 0.8})]
        better = [_summary_run("kvcmas", **{metric: 0.8 if higher else 0.4})]
        assert failed(evaluate_gates(baseline, worse, [gate])) == 1, f"{metric}: a change for the worse passed"
        assert failed(evaluate_gates(baseline, better, [gate])) == 0, f"{metric}: a change for the better failed"


def _ci_default_gates() -> list[str]:
    """The gates scripts/ci_regression.sh applies when KVBENCH_GATES is not set."""
    import re
    import shlex

    script = (ROOT / "scripts" / "ci_regression.sh").read_text()
    default = re.search(r"KVBENCH_GATES:-([^}]*)}", script)
    assert default is not None
    words = shlex.split(default.group(1).replace("$METHOD", "kvcmas"))
    return [words[i + 1] for i, word in enumerate(words) if word == "--gate"]


def test_ci_default_gates_fail_each_regression_and_pass_the_baseline() -> None:
    from kvbench.analysis.compare import Gate, evaluate_gates

    gates = [Gate.parse(text) for text in _ci_default_gates()]
    assert {g.metric for g in gates} >= {"p50_ttft_ms", "task_accuracy_reuse", "exact_match_rate", "mean_token_f1"}
    good = {"p50_ttft_ms": 100.0, "task_accuracy_reuse": 0.9, "exact_match_rate": 0.8, "mean_token_f1": 0.95}

    def side(kvcmas: dict[str, float], nonshared_ttft: float = 200.0) -> list[Run]:
        return [_summary_run("kvcmas", **kvcmas), _summary_run("nonshared", p50_ttft_ms=nonshared_ttft,
                                                              task_accuracy_reuse=1.0, exact_match_rate=1.0,
                                                              mean_token_f1=1.0)]

    assert (evaluate_gates(side(good), side(good), gates)["status"] == "pass").all()
    regressions = {"p50_ttft_ms": 300.0, "task_accuracy_reuse": 0.6, "exact_match_rate": 0.5, "mean_token_f1": 0.8}
    for metric, value in regressions.items():
        result = evaluate_gates(side(good), side({**good, metric: value}), gates)
        failing = result[result["status"].str.startswith("FAIL")]["gate"].tolist()
        assert len(failing) == 1 and metric in failing[0], f"{metric} regressed: {failing}"
