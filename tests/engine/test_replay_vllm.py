"""End-to-end replays against real vLLM on the embedded model, including a server killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
from click.testing import CliRunner
from paths import DATA

from kvbench.cli import main
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

ARGS = ["--shared-tokens", "512", "--output-len", "16", "--save-prompt-ids"]


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def _weights_bytes(model: str) -> int:
    from safetensors import safe_open

    total = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            total += sum(weights.get_tensor(name).nbytes for name in weights.keys())
    return total


@pytest.mark.parametrize("qps", ["0", "2"])
def test_replay_end_to_end(vllm_server: VLLMServer, tmp_path: Path, qps: str) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["replay", "--base-url", vllm_server.base_url, "--qps", qps,
                                       "--num-trajectories", "3", "--num-warmups", "1", *ARGS,
                                       "--result-dir", str(out), "--metadata", "purpose=test"],
                                prog_name="kvbench")
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(out / "requests.parquet")
    summary = json.loads((out / "summary.json").read_text())
    assert len(requests) == 12 and requests["success"].all()
    assert "t000000" not in set(requests["trajectory_id"])  # the warm-up is excluded
    # Each agent's real output (as the server generated it) is inside the next agents' prompts,
    # and the prompts are what the server saw (echoed back by vLLM).
    for _, turns in requests.groupby("trajectory_id"):
        by_turn = turns.set_index("turn_id")
        for source, target in [("A0.r0", "A1.r0"), ("A0.r0", "A3.r0"), ("A2.r0", "A3.r0")]:
            assert _contains(list(by_turn.loc[target, "prompt_token_ids"]),
                             list(by_turn.loc[source, "output_token_ids"]))
        assert (by_turn["output_tokens"] == 16).all()
        assert (by_turn["prompt_tokens"] == by_turn["prompt_token_ids"].map(len)).all()
    # The summary agrees with requests.parquet recomputed independently.
    ttft = requests["ttft_ms"].to_numpy()
    assert summary["completed"] == 12 and summary["failed"] == 0
    # memory as the paper counts it, the CPU twin: the model's weights as its files hold them
    # (each storage once), vLLM's KV pool, no connector state
    parts = summary["memory_parts_gib"]
    assert summary["peak_gpu_memory_gib"] is None
    assert summary["peak_cpu_tensor_memory_gib"] == pytest.approx(sum(parts.values()))
    assert parts["model_weights"] * 2**30 == pytest.approx(_weights_bytes(vllm_server.config.model), rel=0.01)
    assert parts["kv_pool"] > 0 and parts["store"] == parts["method_state"] == 0
    assert summary["p50_ttft_ms"] == pytest.approx(np.percentile(ttft, 50))
    assert summary["p90_ttft_ms"] == pytest.approx(np.percentile(ttft, 90))
    assert summary["mean_e2el_ms"] == pytest.approx(requests["e2el_ms"].mean())
    assert summary["total_output_tokens"] == requests["output_tokens"].sum()
    assert summary["mean_trajectory_ttft_ms"] == pytest.approx(requests.groupby("trajectory_id")["ttft_ms"].mean().mean())
    for key in ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
                *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p90", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el"))):
        assert key in summary, key
    assert summary["purpose"] == "test" and summary["config"]["trace_header"]["format"] == "kvbench-trace"
    import vllm

    assert summary["config"]["vllm_version"] == vllm.__version__  # what the server's /version says
    assert summary["prefix_cache_queries"] > 0
    # vLLM reports prefix-cache hits per request, and every agent's own system prompt repeats
    assert summary["cached_tokens"] == requests["cached_tokens"].sum() > 0
    if qps == "0":  # single stream: trajectories never overlap
        spans = requests.groupby("trajectory_id").agg(start=("scheduled_ns", "min"), end=("end_ns", "max"))
        spans = spans.sort_values("start")
        assert (spans["start"].to_numpy()[1:] >= spans["end"].to_numpy()[:-1]).all()


def test_a_benchmark_workload_replays_and_its_final_answers_are_scored(vllm_server: VLLMServer, tmp_path: Path) -> None:
    """HumanEval's workflow on real vLLM: each agent's output (stopped at EOS or the cap) feeds the
    next, and the run is scored as it finishes, the harness having run every final answer."""
    trace = tmp_path / "humaneval.jsonl"
    data = DATA / "humaneval-sample.jsonl"
    made = CliRunner().invoke(main, ["gen-trace", "-o", str(trace), "--task", "humaneval", "--data", str(data),
                                     "--output-len", "12", "--qps", "0"])
    assert made.exit_code == 0, made.output
    out = tmp_path / "run"
    args = ["replay", "--trace", str(trace), "--base-url", vllm_server.base_url, "--qps", "0", "--num-warmups", "0",
            "--result-dir", str(out)]
    refused = CliRunner().invoke(main, args, env={"KVBENCH_ALLOW_CODE_EXECUTION": ""})
    # scoring runs model-written code: without consent, refused before anything is sent
    assert refused.exit_code == 1 and "--allow-code-execution" in refused.output and not out.exists()
    result = CliRunner().invoke(main, [*args, "--allow-code-execution"])
    assert result.exit_code == 0, result.output
    requests = pd.read_parquet(out / "requests.parquet")
    assert len(requests) == 8 and requests["success"].all() and (requests["output_tokens"] <= 12).all()
    scores = pd.read_parquet(out / "task_scores.parquet")
    assert scores["item_id"].tolist() == ["KVBench/0", "KVBench/1"] and scores["final"].all()
    # the constructed model writes no working code: every check ran and failed (none "no output")
    assert scores["detail"].str.match(r"failed|timed out").all() and not scores["correct"].any()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task_accuracy"] == 0.0 and summary["task_scored_trajectories"] == 2


def test_killed_server_keeps_results_and_resume_completes(vllm_server: VLLMServer, default_model: str,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "kvbench", "replay", "--qps", "0", "--num-trajectories", "6",
               "--shared-tokens", "2048", "--output-len", "64", "--result-dir", str(out)]
    replay = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = out / "requests.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not journal.exists() or len(journal.read_text().splitlines()) < 5):
        assert replay.poll() is None, replay.communicate()
        time.sleep(0.2)
    servers = [p for p in psutil.Process(replay.pid).children(recursive=True)
               if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
    assert servers, "the replayer did not start its own server"
    os.killpg(os.getpgid(servers[0].pid), signal.SIGKILL)
    stdout, stderr = replay.communicate(timeout=120)
    assert replay.returncode == 1, stdout + stderr
    assert "aborted" in stderr and "--resume" in stderr
    assert "killed by SIGKILL" in " ".join(stderr.split()), stderr  # not "exited with code -9"
    partial = pd.read_parquet(out / "requests.parquet")  # readable after the crash
    assert partial["success"].sum() >= 5 and len(partial) < 24

    resumed = CliRunner().invoke(main, ["replay", "--qps", "0", "--num-trajectories", "6", "--shared-tokens", "2048",
                                        "--output-len", "64", "--result-dir", str(out), "--resume",
                                        "--base-url", vllm_server.base_url], prog_name="kvbench")
    assert resumed.exit_code == 0, resumed.output
    final = pd.read_parquet(out / "requests.parquet")
    assert len(final) == 24 and final["success"].all()
    assert not final.duplicated(["trajectory_id", "turn_id"]).any()
    kept = partial[partial.groupby("trajectory_id")["success"].transform("all")
                   & (partial.groupby("trajectory_id")["turn_id"].transform("count") == 4)]
    assert set(kept["request_id"]) <= set(final["request_id"])  # finished trajectories were not re-run


def test_sigterm_stops_the_run_and_its_server_tree(default_model: str, tmp_path: Path) -> None:
    """What `timeout`, CI runners and container stops send: the server kvbench started goes with
    every process of it (API server, engine core, workers), and the summary is written."""
    out = tmp_path / "run"
    replay = subprocess.Popen([sys.executable, "-m", "kvbench", "replay", "--method", "fullshared", "--qps", "2",
                               "--num-trajectories", "8", "--shared-tokens", "1024", "--output-len", "32",
                               "--result-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    journal = out / "requests.jsonl"
    deadline = time.monotonic() + 300
    while not journal.exists() or len(journal.read_text().splitlines()) < 3:
        assert replay.poll() is None, replay.communicate()[0]
        assert time.monotonic() < deadline, "the replay never got going"
        time.sleep(0.2)
    started = psutil.Process(replay.pid).children(recursive=True)
    assert any("vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()) for p in started)
    replay.send_signal(signal.SIGTERM)
    output, _ = replay.communicate(timeout=120)
    assert replay.returncode == 143, output
    survivors = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, f"outlived kvbench: {[(p.pid, p.cmdline()[:3]) for p in survivors]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] == "SIGTERM" and summary["completed"] >= 3
    assert summary["method_stats_missing"] == 0  # the last poll ran before the server stopped
    assert "Traceback" not in output
