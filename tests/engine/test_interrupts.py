"""SIGTERM and SIGINT stop `kvbench replay` cleanly: the server it started goes with its whole
process tree, the summary is written, the exit status is 128 + the signal, and `--resume`
finishes the run as if it had never stopped. The server here is kvbench's stub, started by the
real command line (tests/helpers/kvbench_stub_server.py); test_replay_vllm.py does it with vLLM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from paths import HELPERS

# The slow tier: each test runs `kvbench replay` end to end in subprocesses (5-30 s each).
pytestmark = pytest.mark.engine

HELPER = HELPERS / "kvbench_stub_server.py"


@pytest.fixture(scope="module")
def trace(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    subprocess.run([sys.executable, "-m", "kvbench.cli", "gen-trace", "-o", str(path), "--model",
                    str(tiny_tokenizer_dir), "--num-trajectories", "6", "--shared-tokens", "150", "--output-len", "16"],
                   check=True, capture_output=True)
    return path


def _replay(trace: Path, result_dir: Path, *extra: str, token_delay: float = 0.03) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HELPER), "replay", "--trace", str(trace), "--method", "fullshared",
                             "--qps", "2", "--result-dir", str(result_dir), *extra],
                            env={**os.environ, "STUB_TOKEN_DELAY": str(token_delay)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(result_dir: Path) -> int:
    journal = result_dir / "requests.jsonl"
    return len(journal.read_text().splitlines()) if journal.exists() else 0


def _stop_mid_run(process: subprocess.Popen[str], result_dir: Path, signum: int) -> tuple[list[psutil.Process], str]:
    """Once a few requests are recorded: every process the command started, then the signal."""
    deadline = time.monotonic() + 120
    while _records(result_dir) < 4:
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the replay never got going"
        time.sleep(0.05)
    started = psutil.Process(process.pid).children(recursive=True)
    assert len(started) >= 2  # the stub server and its long-lived child
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    return started, output


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_run_cleanly(trace: Path, tmp_path: Path, signum: int) -> None:
    result_dir = tmp_path / "run"
    process = _replay(trace, result_dir)
    started, output = _stop_mid_run(process, result_dir, signum)
    assert process.returncode == 128 + signum, output
    assert not _alive(started), f"processes outlived kvbench: {_alive(started)}"
    assert "Traceback" not in output and f"interrupted by {signal.Signals(signum).name}" in output
    summary = json.loads((result_dir / "summary.json").read_text())
    assert summary["interrupted"] == signal.Signals(signum).name
    requests = pd.read_parquet(result_dir / "requests.parquet")
    assert len(requests) == summary["completed"] + summary["failed"] >= 4
    # requests in flight when the signal came are recorded, as interrupted
    assert set(requests[~requests["success"]]["error_type"]) <= {"interrupted", "dependency_failed"}
    segment = summary["config"]["segments"][0]
    assert segment["status"] == f"interrupted by {signal.Signals(signum).name}"
    assert segment["duration_s"] * 1e9 >= requests["end_ns"].max()  # serving time covers what was recorded


def test_a_resumed_run_equals_an_uninterrupted_one(trace: Path, tmp_path: Path) -> None:
    whole = _replay(trace, tmp_path / "whole", token_delay=0.005)
    assert whole.wait(timeout=300) == 0, whole.communicate()[0]
    stopped_dir = tmp_path / "stopped"
    _, output = _stop_mid_run(_replay(trace, stopped_dir), stopped_dir, signal.SIGTERM)
    before = json.loads((stopped_dir / "summary.json").read_text())
    resumed = _replay(trace, stopped_dir, "--resume", token_delay=0.005)
    assert resumed.wait(timeout=300) == 0, resumed.communicate()[0]

    runs = {name: (pd.read_parquet(tmp_path / name / "requests.parquet"),
                   json.loads((tmp_path / name / "summary.json").read_text())) for name in ("whole", "stopped")}
    (whole_requests, whole_summary), (requests, summary) = runs["whole"], runs["stopped"]
    key = ["trajectory_id", "turn_id"]
    assert requests.groupby(key).size().eq(1).all()  # each (trajectory, turn) exactly once
    assert sorted(map(tuple, requests[key].values)) == sorted(map(tuple, whole_requests[key].values))
    assert requests["success"].all() and summary["completed"] == whole_summary["completed"]
    # every request has its method stats, the same as the uninterrupted run's
    assert summary["method_stats_missing"] == 0 and requests["reused_tokens"].notna().all()
    merged = requests.merge(whole_requests, on=key, suffixes=("", "_whole"))
    for column in ("reused_tokens", "eligible_tokens", "recomputed_tokens", "reusable_tokens", "prompt_tokens"):
        assert (merged[column] == merged[f"{column}_whole"]).all(), column
    assert summary["realized_rho"] == whole_summary["realized_rho"]
    # the duration counts both segments' serving time, not the resumed part alone
    segments = summary["config"]["segments"]
    assert len(segments) == 2 and segments[0]["duration_s"] == before["duration"]
    assert summary["duration"] == pytest.approx(sum(s["duration_s"] for s in segments))
    assert summary["request_throughput"] == pytest.approx(summary["completed"] / summary["duration"])


def test_a_killed_kvbench_still_takes_its_server_down(trace: Path, tmp_path: Path) -> None:
    """SIGKILL cannot be caught; the server is told to stop by the kernel (parent-death signal)."""
    result_dir = tmp_path / "run"
    process = _replay(trace, result_dir, token_delay=0.05)
    deadline = time.monotonic() + 120
    while _records(result_dir) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        time.sleep(0.05)
    (server,) = [p for p in psutil.Process(process.pid).children() if "kvbench.replay.stub" in " ".join(p.cmdline())]
    group = os.getpgid(server.pid)
    process.kill()
    process.wait(timeout=30)
    try:  # it got SIGTERM when kvbench died, and stopped. Its new parent may never reap it (a
        # container's PID 1 need not), so a zombie counts as stopped: psutil's wait would block on it.
        deadline = time.monotonic() + 30
        while _alive([server]) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # the stub's SIGTERM-proof child, left for this test's cleanup
    assert not _alive([server])
