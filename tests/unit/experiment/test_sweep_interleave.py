"""`kvbench sweep --interleave` (issue 65 item 1) against kvbench's stub servers: every method's
server up side by side, cell k of each method back to back in a rotating order, each (trace, QPS,
repeat) one comparison the report pairs within, and the spread between repeats beside each run's
interval."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paths import HELPERS, ROOT

from kvbench.analysis.runs import find_runs
from kvbench.analysis.savings import reuse_turn_savings

GRID = ["--methods", "nonshared,fullshared", "--shared-tokens", "64", "--qps", "0,4", "--num-trajectories", "3",
        "--output-len", "4", "--num-warmups", "0", "--repeats", "2"]


def _sweep(out: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STUB_TOKEN_DELAY": "0", "PYTHONPATH": str(HELPERS)}
    return subprocess.run([sys.executable, str(HELPERS / "kvbench_stub_server.py"), "sweep", "-o", str(out), *GRID,
                           "--model", str(model), *extra], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_an_interleaved_sweep_runs_each_cell_of_every_method_back_to_back(tiny_tokenizer_dir: Path,
                                                                          tmp_path: Path) -> None:
    done = _sweep(tmp_path / "s", tiny_tokenizer_dir, "--interleave")
    assert done.returncode == 0, done.stderr
    runs = sorted(find_runs([tmp_path / "s"]), key=lambda run: run.started or 0)
    assert len(runs) == 12  # (nonshared, fullshared, and nonshared again: the A/A arm) x 2 QPS x 2 repeats
    sweep_id = (tmp_path / "s" / "comparison-id").read_text().strip()
    for k in range(0, len(runs), 3):  # each round: the same cell of every configuration, one comparison
        arms = runs[k:k + 3]
        assert sorted(run.name for run in arms) == ["fullshared", "nonshared", "nonshared-aa"]
        assert len({run.path.name for run in arms}) == 1, [run.path for run in arms]
        assert len({run.comparison for run in arms}) == 1 and arms[0].comparison.startswith(sweep_id)
        assert all(run.interleaved for run in arms)
    assert len({run.comparison for run in runs}) == 4
    units = {run.path.name: run.config["comparison"]["unit"] for run in runs}
    assert units == {"ctx64-a4-r1-qps0-rep0": "trajectory", "ctx64-a4-r1-qps0-rep1": "trajectory",
                     "ctx64-a4-r1-qps4-rep0": "cell", "ctx64-a4-r1-qps4-rep1": "cell"}
    # single stream: each round's runs took turns a trajectory at a time, each turn recorded
    for run in runs:
        if run.summary["request_rate"] == 0:
            assert run.config["interleaved"], run.path
    # under load, a cell at a time, in an order that rotates from one round to the next
    loaded = [run for run in runs if run.summary["request_rate"] > 0]
    assert loaded[0].name != loaded[3].name
    savings = reuse_turn_savings(runs).set_index("run")
    fullshared = savings[savings.index.str.startswith("fullshared")]
    floors = savings[savings.index.str.startswith("nonshared-aa")]
    # each FullShared cell against its own repeat's NonShared cell, beside that comparison's A/A arm
    assert len(fullshared) == 4 and len(floors) == 4 and (floors["reuse_finding"] == "noise floor").all()
    assert (fullshared["reuse_noise_floor"] != "").all()
    assert fullshared["reuse_repeats"].str.endswith("over 2").all(), fullshared["reuse_repeats"].tolist()


def test_a_sweep_without_interleave_runs_one_method_after_another_and_resumes_only_so(
        tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    grid = ["--qps", "0", "--repeats", "1"]
    assert _sweep(tmp_path / "s", tiny_tokenizer_dir, *grid).returncode == 0
    runs = sorted(find_runs([tmp_path / "s"]), key=lambda run: run.started or 0)
    assert [run.method for run in runs] == ["nonshared", "fullshared"] and runs[0].comparison is None
    cell = next((tmp_path / "s" / "runs" / "fullshared").glob("ctx64-*"))
    summary = json.loads((cell / "summary.json").read_text())
    summary["interrupted"] = "SIGTERM"  # a cell to run again
    (cell / "summary.json").write_text(json.dumps(summary))
    mixed = _sweep(tmp_path / "s", tiny_tokenizer_dir, *grid, "--interleave")
    assert mixed.returncode == 1 and "swept without --interleave: resume it the same way" in mixed.stderr
    assert _sweep(tmp_path / "s", tiny_tokenizer_dir, *grid).returncode == 0
