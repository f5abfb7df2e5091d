"""Over-saturation: the detector on known series, and a replay past a stand-in server's capacity
that stops early and is marked saturated in its summary, the report and comparisons."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvbench import run_files
from kvbench.cli import main
from kvbench.replay.saturation import SaturationDetector, SaturationRule
from kvbench.replay.stub import StubServer

RULE = SaturationRule(min_duration_s=2.0, min_requests=12)


def _feed(detector: SaturationDetector, times: np.ndarray, ttfts: np.ndarray, backlogs: np.ndarray) -> float | None:
    """The time of the verdict, or None."""
    for t, ttft, backlog in zip(times, ttfts, backlogs):
        if detector.observe(float(t), float(ttft), int(backlog)) is not None:
            return float(t)
    return None


def test_a_growing_queue_is_over_saturated_and_a_steady_one_is_not() -> None:
    rng = np.random.default_rng(0)
    times = np.linspace(0.5, 30.0, 120)
    # Past capacity: each request waits behind all the work that arrived before it.
    growing = _feed(SaturationDetector(RULE), times, 100 + 80 * times + rng.normal(0, 30, len(times)),
                    np.floor(0.4 * times) + rng.integers(0, 2, len(times)))
    assert growing is not None and growing >= RULE.min_duration_s
    # Steady: TTFT and backlog fluctuate around a level, bursts included, for the whole run.
    steady = _feed(SaturationDetector(RULE), times, 150 + rng.normal(0, 60, len(times)) + 200 * (rng.random(len(times)) < 0.1),
                   rng.integers(0, 4, len(times)))
    assert steady is None
    # TTFT grows but the backlog does not (longer prompts later in the run): no verdict.
    longer_prompts = _feed(SaturationDetector(RULE), times, 100 + 10 * times, rng.integers(1, 3, len(times)))
    assert longer_prompts is None


def test_no_verdict_before_the_rule_has_seen_enough() -> None:
    detector = SaturationDetector(SaturationRule(min_duration_s=10.0, min_requests=12))
    times = np.linspace(0.1, 9.5, 50)
    assert _feed(detector, times, 100 + 500 * times, np.arange(50) // 3) is None  # within 10 s
    assert detector.observe(11.0, 6000.0, 20) is not None  # the same growth, past it
    few = SaturationDetector(SaturationRule(min_duration_s=0.0, min_requests=30))
    assert _feed(few, np.linspace(1, 20, 20), 100 + 500 * np.linspace(1, 20, 20), np.arange(20)) is None
    assert few.observe(math.nan, 10.0, 3) is None  # a request without a TTFT is no evidence


def _saturating_replay(tiny_tokenizer_dir: Path, out: Path, stub: StubServer, *extra: str):
    return CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--base-url", stub.base_url,
                                     "--qps", "40", "--num-trajectories", "80", "--shared-tokens", "32",
                                     "--output-len", "2", "--result-dir", str(out), *extra], prog_name="kvbench")


def test_a_replay_past_the_servers_capacity_stops_early_and_is_marked_saturated(
        tiny_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in server that serves 40 first tokens a second, one at a time, fed 40 four-agent
    workflows a second (160 requests a second): the queue grows from the start."""
    import kvbench.replay.saturation as saturation

    monkeypatch.setattr(saturation, "SaturationRule", lambda: RULE)  # the CLI's rule, shortened for a test
    with StubServer(prefill_s=0.025) as stub:
        result = _saturating_replay(tiny_tokenizer_dir, tmp_path / "sat", stub, "--stop-on-saturation")
        assert result.exit_code == 0, result.output
        assert "saturated:" in result.output and "over-saturated at" in result.output
        summary = json.loads((tmp_path / "sat" / run_files.SUMMARY).read_text())
        assert summary["saturated"] is True and summary["saturation"]["ttft_slope_low"] > 0
        assert summary["saturation"]["backlog_slope_low"] > 0 and summary["saturation"]["ttft_growth"] >= 2
        # It stopped: far fewer requests than the 320 of the whole trace, none of them failures.
        assert summary["completed"] < 200 and summary["failed"] == 0
        records = run_files.load_requests(tmp_path / "sat").frame
        stopped = records[records["error_type"] == run_files.SATURATION_STOP]
        assert summary["saturation_stopped_requests"] == len(stopped) > 0
        assert "over-saturated" in stopped["error_message"].iloc[0]
        config = json.loads((tmp_path / "sat" / run_files.CONFIG).read_text())
        assert config["segments"][-1]["status"] == "saturated"
        assert config["stop_on_saturation"]["min_requests"] == RULE.min_requests
        # Resuming would only queue the same overload again.
        resumed = _saturating_replay(tiny_tokenizer_dir, tmp_path / "sat", stub, "--stop-on-saturation", "--resume")
        assert resumed.exit_code != 0 and "stopped over-saturated" in resumed.output
        # A single stream never is: the same server at QPS 0 runs to the end.
        single = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--base-url", stub.base_url,
                                           "--qps", "0", "--num-trajectories", "3", "--shared-tokens", "32",
                                           "--output-len", "2", "--stop-on-saturation",
                                           "--result-dir", str(tmp_path / "steady")], prog_name="kvbench")
        assert single.exit_code == 0, single.output
    steady = json.loads((tmp_path / "steady" / run_files.SUMMARY).read_text())
    assert steady["saturated"] is False and steady["completed"] == 12

    report = CliRunner().invoke(main, ["report", str(tmp_path / "sat"), str(tmp_path / "steady"),
                                       "--out", str(tmp_path / "report")], prog_name="kvbench")
    assert report.exit_code == 0, report.output
    text = (tmp_path / "report" / "report.md").read_text()
    assert "[saturated]" in text and "**Saturated**" in text
    # A candidate that saturates where its baseline did not fails a comparison's gates, even when
    # every gate on its figures passes. The baseline: the same cell's run, marked as one that ran to
    # its end (a real unsaturated replay of this load can itself saturate on a busy machine).
    import shutil

    shutil.copytree(tmp_path / "sat", tmp_path / "base")
    summary = json.loads((tmp_path / "base" / run_files.SUMMARY).read_text())
    summary.update(saturated=False, saturation=None)
    (tmp_path / "base" / run_files.SUMMARY).write_text(json.dumps(summary))
    compare = CliRunner().invoke(main, ["compare", str(tmp_path / "base"), str(tmp_path / "sat"),
                                        "--gate", "failed=+0"], prog_name="kvbench")
    assert compare.exit_code == 1, compare.output
    assert "no cell newly saturated" in compare.output and "REGRESSION: 1 gate" in compare.output
    same = CliRunner().invoke(main, ["compare", str(tmp_path / "base"), str(tmp_path / "base"),
                                     "--gate", "failed=+0"], prog_name="kvbench")
    assert same.exit_code == 0 and "newly saturated" not in same.output


def test_without_the_flag_the_same_replay_runs_to_its_end(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    with StubServer(prefill_s=0.002) as stub:
        result = CliRunner().invoke(main, ["replay", "--model", str(tiny_tokenizer_dir), "--base-url", stub.base_url,
                                           "--qps", "40", "--num-trajectories", "20", "--shared-tokens", "32",
                                           "--output-len", "2", "--result-dir", str(tmp_path / "r")], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / run_files.SUMMARY).read_text())
    assert summary["saturated"] is False and summary["completed"] == 80 and summary["saturation_stopped_requests"] == 0


def test_ttft_growth_is_measured_from_the_first_observation_not_from_zero() -> None:
    """A run whose first request finishes at 20 s: TTFT rising from 1,800 to 2,600 ms while the
    backlog grows is a growth of 1.44 since the run's first observation, short of the rule's 2; from
    t = 0 the same line would read 2.6 (a verdict on a run that only got slower by half)."""
    times = np.linspace(20.0, 40.0, 80)
    verdict = _feed(SaturationDetector(RULE), times, 1000 + 40 * times, np.floor(0.5 * times))
    assert RULE.min_ttft_growth == 2 and verdict is None
    doubled = _feed(SaturationDetector(RULE), times, -1000 + 90 * times, np.floor(0.5 * times))  # 800 -> 2,600 ms
    assert doubled is not None
