"""Faults a user meets, against the stub server: every trace that validates replays, and one
that does not is refused before anything is sent; a server that dies or was never there, method
stats that survive a crash, a /metrics page that is not Prometheus text, store accounting."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.replay.stub import StubServer


def _kvbench(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="kvbench")


@pytest.fixture(scope="module")
def trace(small_trace) -> Path:
    return small_trace(trajectories=4, shared_tokens=120, output_len=6)


def _clean_failure(result, *messages: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    for message in messages:
        assert message in result.output, result.output


def test_replay_refuses_a_trace_validate_refuses_before_sending_anything(trace: Path, tmp_path: Path) -> None:
    lines = trace.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["shared"]["q"]["num_tokens"] += 7
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([lines[0], lines[1], json.dumps(bad), *lines[3:]]) + "\n")
    with StubServer() as stub:
        result = _kvbench("replay", "--trace", str(path), "--base-url", stub.base_url, "--qps", "0",
                          "--result-dir", str(tmp_path / "run"))
    _clean_failure(result, "line 3: shared.q.num_tokens: declares")
    assert not stub.prompts and not (tmp_path / "run").exists()


def test_turns_longer_than_the_servers_context_are_refused_up_front(trace: Path, tmp_path: Path) -> None:
    with StubServer(max_model_len=64) as stub:
        result = _kvbench("replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                          "--result-dir", str(tmp_path / "run"))
    _clean_failure(result, "turns need more tokens than the server's max_model_len 64")
    assert not stub.prompts and not (tmp_path / "run" / "config.json").exists()


def _wait_healthy(url: str) -> None:
    from kvbench.server.lifecycle import health_ok

    deadline = time.monotonic() + 30
    while not health_ok(url):
        assert time.monotonic() < deadline, f"stub at {url} never became healthy"
        time.sleep(0.1)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_run_that_never_reached_a_server_can_simply_be_run_again(trace: Path, tmp_path: Path) -> None:
    args = ("replay", "--trace", str(trace), "--base-url", f"http://127.0.0.1:{_closed_port()}",
            "--result-dir", str(tmp_path / "run"))
    for _ in range(2):  # the second time is not refused as "already holds results"
        _clean_failure(_kvbench(*args), "cannot reach a vLLM server")
    assert not (tmp_path / "run" / "config.json").exists() and not (tmp_path / "run" / "requests.jsonl").exists()
    with StubServer() as stub:
        result = _kvbench("replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                          "--result-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output


def test_a_metrics_page_that_is_not_prometheus_text_does_not_end_the_run(trace: Path, tmp_path: Path) -> None:
    with StubServer(metrics_text="<html><body>502 Bad Gateway</body></html>") as stub:
        result = _kvbench("replay", "--trace", str(trace), "--base-url", stub.base_url, "--qps", "0",
                          "--result-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["completed"] == 16


def test_tokenizer_mismatch_names_both_tokenizers(trace: Path, tmp_path: Path) -> None:
    from kvbench.model.tokenizer import save_hf_tokenizer, train_tokenizer

    other = tmp_path / "other-tokenizer"
    save_hf_tokenizer(train_tokenizer(["a different corpus entirely, " * 20], vocab_size=300), other, 4096)
    with StubServer() as stub:
        result = _kvbench("replay", "--trace", str(trace), "--model", str(other), "--base-url", stub.base_url,
                          "--result-dir", str(tmp_path / "run"))
    _clean_failure(result, "line 1: tokenizer_sha256: the trace was made with tokenizer", str(other),
                   f"kvbench gen-trace --model {other}")
    assert "None" not in result.output


def test_method_stats_survive_a_server_crash_and_resume(trace: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Stats are journaled as the run goes (every HEARTBEAT_S): a crash loses at most the last
    poll's worth, and the summary names exactly which requests have none."""
    from kvbench.replay import runner

    monkeypatch.setattr(runner, "HEARTBEAT_S", 0.1)
    run = tmp_path / "run"
    port = _closed_port()
    server = subprocess.Popen([sys.executable, "-m", "kvbench.replay.stub", "--port", str(port), "--connector",
                               "--token-delay", "0.05"], stdout=subprocess.DEVNULL)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        threading.Timer(2.0, server.kill).start()  # the server dies mid-run (SIGKILL: no goodbye)
        crashed = _kvbench("replay", "--trace", str(trace), "--method", "fullshared", "--base-url",
                           f"http://127.0.0.1:{port}", "--qps", "0", "--result-dir", str(run))
    finally:
        server.kill()
        server.wait()
    # A clear line, never a traceback (an uncaught exception is not a SystemExit): either the run
    # aborted (exit 1) or it finished with the dead server's requests recorded as failed.
    assert "Traceback" not in crashed.output
    assert crashed.exception is None or isinstance(crashed.exception, SystemExit)
    if "run aborted" in crashed.output:
        assert crashed.exit_code == 1
    else:
        assert "requests failed" in crashed.output
        assert json.loads((run / "summary.json").read_text())["failed"] > 0
    journaled = {json.loads(line)["request_id"] for line in (run / "method_stats.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "request"}
    first = pd.read_parquet(run / "requests.parquet")
    done_before = set(first[first["success"]]["request_id"])
    assert journaled and journaled <= done_before

    with StubServer(connector=True) as stub:
        resumed = _kvbench("replay", "--trace", str(trace), "--method", "fullshared", "--base-url", stub.base_url,
                           "--qps", "0", "--result-dir", str(run), "--resume")
    assert resumed.exit_code == 0, resumed.output
    requests = pd.read_parquet(run / "requests.parquet")
    summary = json.loads((run / "summary.json").read_text())
    assert requests.groupby(["trajectory_id", "turn_id"]).size().eq(1).all() and len(requests) == 16
    assert requests["success"].all()
    missing = set(summary["method_stats_missing_requests"])
    assert summary["method_stats_missing"] == len(missing)
    assert missing == set(requests[requests["reused_tokens"].isna()]["request_id"])
    kept = set(requests["request_id"]) & done_before
    assert kept & journaled and not (kept & journaled & missing)  # what was journaled before the crash is kept
    assert summary["segments"] == 2
    assert summary["duration"] == pytest.approx(sum(s["duration_s"] for s in summary["config"]["segments"]))


def test_summary_reports_store_accounting(trace: Path, tmp_path: Path) -> None:
    with StubServer(connector=True) as stub:
        result = _kvbench("replay", "--trace", str(trace), "--method", "fullshared", "--base-url", stub.base_url,
                          "--qps", "0", "--result-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("method_store_peak_bytes", "store_evictions", "store_refused", "realized_rho", "eligible_rho",
                "reuse_lost_to_eviction_tokens", "reuse_lost_to_eviction_share"):
        assert key in summary
    assert summary["store_evictions"] == 0 and summary["reuse_lost_to_eviction_tokens"] == 0
    assert summary["realized_rho"] == 1.0  # the stub reports every reusable row as reused
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    reuse = requests[requests["reusable_tokens"] > 0]
    assert (reuse["reused_tokens"] == reuse["reusable_tokens"]).all()


def test_a_chain_of_hundreds_of_turns_replays(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    system = "You check the previous step."
    turns = [{"turn_id": f"T{i}", "agent": "A0", "after": [f"T{i - 1}"] if i else [], "max_tokens": 1,
              "segments": [{"pf": "system"}, *([{"ph": f"out:T{i - 1}"}] if i else [])]} for i in range(300)]
    trajectory = {"trajectory_id": "t0", "arrival_s": 0.0, "turns": turns[::-1],
                  "agents": {"A0": {"role": "R", "system": system, "system_tokens": len(tokenizer.encode(system))}}}
    header = {"format": "kvbench-trace", "version": 1, "generator": {}, "tokenizer": str(tiny_tokenizer_dir),
              "tokenizer_sha256": tokenizer.sha256}
    path = tmp_path / "chain.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(trajectory) + "\n")
    with StubServer() as stub:
        result = _kvbench("replay", "--trace", str(path), "--base-url", stub.base_url, "--qps", "0",
                          "--result-dir", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["completed"] == 300


def test_a_sweep_resumes_cells_that_were_stopped(tmp_path: Path) -> None:
    from kvbench.experiment.sweep import cell_done

    for ending, done in (({"aborted": None, "interrupted": None}, True), ({"aborted": None, "interrupted": "SIGTERM"}, False),
                         ({"aborted": "server died", "interrupted": None}, False)):
        cell = tmp_path / str(len(list(tmp_path.iterdir())))
        cell.mkdir()
        (cell / "summary.json").write_text(json.dumps(ending))
        assert cell_done(cell) is done, ending
    assert not cell_done(tmp_path / "never-ran")
