"""`kvbench sweep --find-max-qps` (issue 51 item 3): the search over rates, its bracket and
intervals, and the command around it (servers stood in for, each probe's summary made up from
the rate so the answer is known; the probes' replays are ordinary sweep cells, tested elsewhere)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.experiment import max_qps
from kvbench.experiment.max_qps import Probe, bracket, search_rates, wilson_interval


def _probe_with_capacity(capacity: float, seen: list[float]):
    def probe(qps: float) -> Probe:
        seen.append(qps)
        share = 1.0 if qps <= capacity else 0.5
        return Probe(qps, share, int(share * 10), 10, *wilson_interval(int(share * 10), 10), share >= 0.9, "")
    return probe


def test_the_search_doubles_then_bisects_to_a_bracket_around_the_capacity() -> None:
    seen: list[float] = []
    probes = search_rates(_probe_with_capacity(3.3, seen), start=1.0, low=0.125, high=16, steps=3)
    assert seen[:3] == [1.0, 2.0, 4.0]  # doubling until the first failure
    # then geometric bisection of the bracket, each rate to three significant digits: sqrt(2 * 4),
    # sqrt(2.83 * 4), sqrt(2.83 * 3.36) (any other rule, arithmetic or not, probes elsewhere)
    assert seen[3:] == [2.83, 3.36, 3.08]
    passing, failing = bracket(probes)
    assert passing is not None and failing is not None
    assert passing <= 3.3 < failing and failing / passing < 1.2  # three bisections narrow [2, 4]


def test_a_start_above_capacity_halves_first() -> None:
    seen: list[float] = []
    probes = search_rates(_probe_with_capacity(0.7, seen), start=4.0, low=0.125, high=16, steps=0)
    assert seen == [4.0, 2.0, 1.0, 0.5] and bracket(probes) == (0.5, 1.0)


def test_a_rate_range_that_never_fails_or_never_passes_says_so() -> None:
    assert bracket(search_rates(_probe_with_capacity(100, []), 1.0, 0.125, 16, 3)) == (16, None)
    assert bracket(search_rates(_probe_with_capacity(0.01, []), 1.0, 0.125, 16, 3)) == (None, 0.125)


def test_wilson_interval() -> None:
    low, high = wilson_interval(9, 10)
    assert low == pytest.approx(0.596, abs=1e-3) and high == pytest.approx(0.982, abs=1e-3)
    assert wilson_interval(0, 0)[0] != wilson_interval(0, 0)[0]  # NaN: nothing counted
    assert wilson_interval(10, 10)[1] == 1.0


def test_the_command_searches_every_method_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       tiny_tokenizer_dir: Path) -> None:
    from kvbench.server import lifecycle as server_module

    class StandIn:  # a server that is never started: the probes' summaries are made up below
        def __init__(self, config: Any) -> None:
            self.base_url = "http://127.0.0.1:1"

        def __enter__(self) -> StandIn:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

    capacity = {"nonshared": 1.5, "fullshared": 5.0}
    replayed: list[tuple[str, float]] = []

    def fake_replay(spec, cell, server, inputs, after_cell=None, params=None) -> dict:
        replayed.append((cell.method.name, cell.qps))
        share = 1.0 if cell.qps <= capacity[cell.method.name] else 0.6
        summary = {"workflow_goodput_share": share, "completed_trajectories": 20, "failed_trajectories": 0}
        cell.path.mkdir(parents=True, exist_ok=True)
        (cell.path / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(server_module, "VLLMServer", StandIn)
    monkeypatch.setattr(max_qps, "replay_cell", fake_replay)
    args = ["sweep", "-o", str(tmp_path / "s"), "--methods", "nonshared,fullshared", "--shared-tokens", "64",
            "--qps", "1", "--output-len", "4", "--num-trajectories", "20", "--model", str(tiny_tokenizer_dir),
            "--find-max-qps", "--slo", "ttft:500", "--search-steps", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "s" / "max_qps.json").read_text())
    assert report["goodput_slo"] == {"ttft": 500.0} and report["target_share"] == 0.9
    answers = {r["method"]: (r["max_qps"], r["first_failing_qps"]) for r in report["results"]}
    assert answers["nonshared"][0] <= 1.5 < answers["nonshared"][1]
    assert answers["fullshared"][0] <= 5.0 < answers["fullshared"][1]
    probe = report["results"][0]["probes"][0]
    assert probe["run"].startswith("runs/nonshared/") and probe["low"] < probe["share"] <= probe["high"]
    assert "highest QPS with workflow goodput" in result.output
    # a rerun finds every probe done and replays nothing
    count = len(replayed)
    assert CliRunner().invoke(main, args).exit_code == 0 and len(replayed) == count


def test_the_search_needs_bounds(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    result = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "s"), "--methods", "nonshared", "--shared-tokens",
                                       "64", "--output-len", "4", "--model", str(tiny_tokenizer_dir), "--find-max-qps"])
    assert result.exit_code == 1 and "--find-max-qps needs the bounds of goodput" in result.output


def test_a_failed_probe_counts_as_failing() -> None:
    cell = SimpleNamespace(qps=2.0, path=Path("/s/runs/m/c"))
    probe = max_qps.probe_of(cell, Path("/s"), None, "workflow", 0.9)  # type: ignore[arg-type]
    assert not probe.passed and math.isnan(probe.share) and probe.run == "runs/m/c"


def test_a_search_that_never_fails_names_no_maximum() -> None:
    """Issue 66: a range up to 1e40 on a workload that never loads the server reported 1e40."""
    never = max_qps.answer(16.0, None, 16.0)
    assert never["max_qps"] is None and never["passed_up_to"] == 16.0 and "never loaded" in never["reason"]
    assert max_qps.answer(None, 0.125, 16.0)["max_qps"] is None
    assert max_qps.answer(2.0, 4.0, 16.0) == {"max_qps": 2.0, "first_failing_qps": 4.0, "passed_up_to": 2.0,
                                              "reason": None}


def test_a_search_range_is_bounded_and_small_probes_are_named() -> None:
    with pytest.raises(ValueError, match="from 0.001 to 10000"):
        max_qps.check_search(0.9, (1e-300, 1e300), 100, "workflows")
    with pytest.raises(ValueError, match="LOW below HIGH"):
        max_qps.check_search(0.9, (4.0, 2.0), 100, "workflows")
    with pytest.raises(ValueError, match="LOW below HIGH"):
        max_qps.check_search(0.9, (2.0, 2.0), 100, "workflows")  # a range of one rate brackets nothing
    needed = max_qps.least_counted(0.9)
    assert wilson_interval(needed, needed)[0] >= 0.9 > wilson_interval(needed - 1, needed - 1)[0]
    warning = max_qps.check_search(0.9, (0.125, 16), 1, "workflows")
    assert warning is not None and f"that needs {needed}" in warning and "1 workflows" in warning
    assert max_qps.check_search(0.9, (0.125, 16), needed, "workflows") is None


def test_the_command_refuses_a_range_before_any_work(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    result = CliRunner().invoke(main, ["sweep", "-o", str(tmp_path / "s"), "--methods", "nonshared", "--shared-tokens",
                                       "64", "--output-len", "4", "--model", str(tiny_tokenizer_dir), "--find-max-qps",
                                       "--slo", "ttft:500", "--qps-range", "1e-300,1e300"])
    assert result.exit_code == 1 and "from 0.001 to 10000" in result.output
    assert not (tmp_path / "s" / "traces").exists()  # nothing generated, nothing replayed
