"""kill -9 loop (issue 38): a replay SIGKILLed at random points and resumed each time ends with
every request exactly once and the same request set and method stats as an uninterrupted run.
The unit tier kills it twice; the engine tier 6 (KVBENCH_KILL_POINTS sets it: 20 and more for a soak)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from kvbench import run_files
from kvbench.replay.stub import StubServer

KILL_POINTS = int(os.environ.get("KVBENCH_KILL_POINTS", "6"))


@pytest.fixture(scope="module")
def trace(small_trace) -> Path:
    return small_trace(trajectories=4, shared_tokens=60, output_len=6)


def _replay(trace: Path, base_url: str, run: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "kvbench.cli", "replay", "--trace", str(trace), "--method", "fullshared",
            "--base-url", base_url, "--qps", "0", "--result-dir", str(run), *(["--resume"] if resume else [])]


def _partial_trajectories(run: Path, turns: int) -> list[str]:
    """Trajectories the journal holds some but not all turns of: a kill now lands mid-trajectory."""
    records = run_files.read_requests_journal(run / run_files.REQUESTS_JOURNAL)
    counts = Counter(r["trajectory_id"] for r in records)
    return [t for t, n in counts.items() if 0 < n < turns]


def _kill_mid_trajectory(command: list[str], run: Path, turns: int) -> list[str]:
    """Start `command`, SIGKILL it as soon as a trajectory is partly recorded; returns those."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _partial_trajectories(run, turns):
        assert process.poll() is None, "the run ended before any trajectory was partly recorded"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.kill()
    _, stderr = process.communicate()
    assert process.returncode == -9 and "Traceback" not in stderr, stderr
    return _partial_trajectories(run, turns)


def _by_turn(run: Path) -> pd.DataFrame:
    requests = pd.read_parquet(run / "requests.parquet")
    return requests.set_index(["trajectory_id", "turn_id"]).sort_index()


@pytest.mark.parametrize("kills", [pytest.param(2, id="2-kills"),
                                   pytest.param(KILL_POINTS, id="many-kills", marks=pytest.mark.engine)])
def test_a_replay_killed_and_resumed_again_and_again_ends_whole(trace: Path, tmp_path: Path, kills: int) -> None:
    rng = random.Random(kills)
    with StubServer(connector=True, token_delay_s=0.05) as stub:
        whole = subprocess.run(_replay(trace, stub.base_url, tmp_path / "whole", False), capture_output=True,
                               text=True, timeout=300)
        assert whole.returncode == 0, whole.stderr
        run = tmp_path / "killed"
        turns = int(_by_turn(tmp_path / "whole").groupby(level="trajectory_id").size().max())
        # the first kill lands mid-trajectory, by construction: its records are void on resume
        assert _kill_mid_trajectory(_replay(trace, stub.base_url, run, False), run, turns)
        killed_at = [-9]
        for _ in range(kills - 1):
            process = subprocess.Popen(_replay(trace, stub.base_url, run, (run / "config.json").exists()),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(rng.uniform(0.5, 6.0))  # start-up, trace loading, sending, writing: anywhere
            process.kill()
            _, stderr = process.communicate()
            killed_at.append(process.returncode)
            assert "Traceback" not in stderr, stderr
        final = subprocess.run(_replay(trace, stub.base_url, run, (run / "config.json").exists()),
                               capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert any(code == -9 for code in killed_at), "no attempt was still running when killed: kill earlier"
    expected, got = _by_turn(tmp_path / "whole"), _by_turn(run)
    assert got.index.is_unique and got["success"].all()  # every request exactly once
    assert list(got.index) == list(expected.index)
    for column in ("prompt_tokens", "reused_tokens", "eligible_tokens", "recomputed_tokens"):
        assert got[column].tolist() == expected[column].tolist(), column
    assert [list(ids) for ids in got["output_token_ids"]] == [list(ids) for ids in expected["output_token_ids"]]
    summary = json.loads((run / "summary.json").read_text())
    reference = json.loads((tmp_path / "whole" / "summary.json").read_text())
    for key in ("completed", "failed", "completed_trajectories", "realized_rho", "total_output_tokens"):
        assert summary[key] == reference[key], key
    assert summary["method_stats_missing"] == 0
