"""Workflow latency and goodput (issue 51 item 3): per-trajectory makespan percentiles, workflows
per second, and the rate of requests and workflows that meet every bound `--goodput` gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench.analysis.goodput import good_requests, goodput_figures, parse_goodput
from kvbench.analysis.metrics import summarize
from kvbench.cli import main
from kvbench.replay.stub import StubServer


def test_parse_goodput_reads_vllms_form() -> None:
    assert parse_goodput(["ttft:200", "tpot:50 e2el:5000", "workflow:20000"]) == {
        "ttft": 200.0, "tpot": 50.0, "e2el": 5000.0, "workflow": 20000.0}
    assert parse_goodput([]) == {}


@pytest.mark.parametrize(("spec", "message"), [("ttft=200", "KEY:MS"), ("itl:5", "KEY:MS"), ("ttft:-1", "positive"),
                                               ("ttft:nan", "positive"), ("ttft:abc", "positive")])
def test_parse_goodput_refuses_bad_bounds(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_goodput([spec])


def _requests() -> pd.DataFrame:
    """Two trajectories of two turns: t0 fast, t1's second turn slow; t2's first turn failed."""
    rows = [("t0", "A0", True, 100.0, 10.0, 400.0, 0, 400), ("t0", "A1", True, 150.0, None, 150.0, 400, 900),
            ("t1", "A0", True, 120.0, 12.0, 500.0, 0, 500), ("t1", "A1", True, 900.0, 20.0, 1500.0, 500, 3000),
            ("t2", "A0", False, None, None, None, 0, 100)]
    frame = pd.DataFrame(rows, columns=["trajectory_id", "turn_id", "success", "ttft_ms", "tpot_ms", "e2el_ms",
                                        "scheduled_ns", "end_ns"])
    frame[["scheduled_ns", "end_ns"]] *= 1_000_000  # ms -> ns
    return frame


def test_a_request_is_good_when_it_succeeded_and_meets_every_bound() -> None:
    good = good_requests(_requests(), {"ttft": 200, "tpot": 15})
    # t0/A1 generated one token (no TPOT): meets the TPOT bound, as in vLLM; t1/A1 misses TTFT;
    # t1/A0 misses nothing; the failed request is never good
    assert good.tolist() == [True, True, True, False, False]


def test_workflow_goodput_needs_every_turn_good_and_the_makespan_bound() -> None:
    requests = _requests()
    makespans = pd.Series({"t0": 900.0, "t1": 3000.0})  # trajectories whose turns all succeeded
    figures = goodput_figures(requests, makespans, duration_s=10.0, bounds={"ttft": 1000})
    assert figures["request_goodput"] == pytest.approx(0.4)  # 4 good requests in 10 s
    assert figures["request_goodput_share"] == pytest.approx(0.8)
    assert figures["workflow_goodput"] == pytest.approx(0.2) and figures["workflow_goodput_share"] == pytest.approx(2 / 3)
    bounded = goodput_figures(requests, makespans, duration_s=10.0, bounds={"ttft": 1000, "workflow": 1000})
    assert bounded["workflow_goodput"] == pytest.approx(0.1) and bounded["goodput_slo"] == {"ttft": 1000, "workflow": 1000}
    assert goodput_figures(requests, makespans, 10.0, {})["request_goodput"] is None


def test_summary_has_workflow_percentiles_and_goodput() -> None:
    requests = _requests()
    for column, value in (("prompt_tokens", 10), ("output_tokens", 4), ("shared_tokens", 0), ("reusable_tokens", 0)):
        requests[column] = value
    requests["itl_ms"] = [np.array([1.0])] * len(requests)
    summary = summarize(requests, 10.0, [50.0, 90.0], {"e2el": 1000})
    assert summary["p50_workflow_ms"] == pytest.approx(1950.0) and summary["p90_workflow_ms"] == pytest.approx(2790.0)
    assert summary["workflow_throughput"] == pytest.approx(0.2)
    assert summary["request_goodput_share"] == pytest.approx(0.6) and summary["workflow_goodput_share"] == pytest.approx(1 / 3)


def test_a_replay_with_goodput_writes_it_to_its_summary(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with StubServer(token_delay_s=0.002) as stub:
        result = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--base-url", stub.base_url,
                                           "--qps", "0", "--num-trajectories", "3", "--shared-tokens", "64",
                                           "--output-len", "4", "--goodput", "ttft:200", "--goodput", "workflow:60000",
                                           "--result-dir", str(tmp_path / "r")], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["goodput_slo"] == {"ttft": 200.0, "workflow": 60000.0}
    assert summary["request_goodput_share"] == 1.0 and summary["workflow_goodput_share"] == 1.0  # a local stub
    assert summary["workflow_goodput"] == pytest.approx(3 / summary["duration"])
    assert summary["p99_workflow_ms"] >= summary["p50_workflow_ms"] > 0
    assert "Workflow goodput" in result.output and "p99_workflow_ms" in result.output
    assert json.loads((tmp_path / "r" / "config.json").read_text())["goodput"] == {"ttft": 200.0, "workflow": 60000.0}


def test_a_bad_goodput_is_refused_before_anything_starts(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["replay", "--goodput", "ttft=200", "--base-url", "http://127.0.0.1:1"])
    assert result.exit_code == 2 and "--goodput takes KEY:MS" in " ".join(result.output.split())


def test_a_request_exactly_at_a_bound_meets_it() -> None:
    """vLLM's rule: a bound is met at equality (`<=`), for requests and for a workflow's makespan;
    a hair above misses it."""
    requests = _requests()
    ttft = float(requests.loc[0, "ttft_ms"])
    at = good_requests(requests, {"ttft": ttft})
    above = good_requests(requests, {"ttft": ttft - 1e-6})
    assert bool(at.iloc[0]) and not bool(above.iloc[0])
    makespans = pd.Series({"t0": 900.0, "t1": 3000.0})
    exact = goodput_figures(requests, makespans, 10.0, {"ttft": 10_000, "workflow": 900.0})
    short = goodput_figures(requests, makespans, 10.0, {"ttft": 10_000, "workflow": 899.999})
    assert exact["workflow_goodput"] == pytest.approx(0.1) and short["workflow_goodput"] == 0.0
