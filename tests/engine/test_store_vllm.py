"""The connector's segment store under a byte cap, on the embedded model: evictions and the
reuse they cost are reported, and each run's figures are its own on a reused server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from vllm_helpers import serving

from kvbench.cli import main
from kvbench.methods.registry import resolve_method
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

CAP_TOKENS = 2048  # the store holds about one cache of a 1,500-token prompt


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of one token in every layer, bf16, plus its int64 token id."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2 + 8


@pytest.fixture(scope="module")
def cap(default_model: str) -> int:
    return CAP_TOKENS * kv_bytes_per_token(default_model)


@pytest.fixture(scope="module")
def capped_server(default_model: str, cap: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    # half a GiB of KV pool: vLLM CPU's own variable took whole GiB only, so 0.5 once stopped vLLM
    config = method_server_config(resolve_method("fullshared"), default_model, max_store_bytes=cap, max_model_len=4096,
                                  cpu_kv_cache_gib=0.5, log_path=Path(tmp_path_factory.mktemp("capped")) / "server.log")
    with serving(config) as server:
        yield server


def _run(server: VLLMServer, out: Path, *args: str) -> dict:
    result = CliRunner().invoke(main, ["replay", "--method", "fullshared", "--base-url", server.base_url,
                                       "--result-dir", str(out), *args], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text())


def test_evictions_and_lost_reuse_are_reported_per_run(capped_server: VLLMServer, default_model: str, cap: int,
                                                      tmp_path: Path) -> None:
    big = ["--shared-tokens", "1500", "--output-len", "8"]
    single = _run(capped_server, tmp_path / "single", "--qps", "0", "--num-trajectories", "2", *big)
    assert single["store_evictions"] > 0  # every new cache pushes the previous one out
    assert cap / 2 < single["method_store_peak_bytes"] <= cap
    # single stream: each turn's source is the latest cache saved, so nothing is lost
    assert single["reuse_lost_to_eviction_tokens"] == 0 and single["realized_rho"] == single["eligible_rho"] > 0.99

    loaded = _run(capped_server, tmp_path / "loaded", "--qps", "8", "--num-trajectories", "6", *big)
    assert loaded["reuse_lost_to_eviction_tokens"] > 0 and loaded["reuse_lost_to_eviction_share"] > 0
    assert loaded["realized_rho"] < loaded["eligible_rho"]
    assert loaded["realized_rho"] == pytest.approx(1 - loaded["reuse_lost_to_eviction_share"], abs=0.01)

    small = _run(capped_server, tmp_path / "small", "--qps", "0", "--num-trajectories", "1",
                 "--shared-tokens", "32", "--output-len", "4")
    # the same server, a run of small caches: its own peak and evictions, not the earlier runs'.
    # The three caches a later turn reads fit (the last agent's is not kept), so the peak is exactly
    # their bytes: every token with K/V (the prompt and the output but its last token).
    per_token = kv_bytes_per_token(default_model)
    requests = pd.read_parquet(tmp_path / "small" / "requests.parquet")
    kept = requests[requests["turn_id"] != "A3.r0"]
    assert len(kept) == 3
    assert small["method_store_peak_bytes"] == per_token * (kept["prompt_tokens"] + kept["output_tokens"] - 1).sum()
    assert small["method_store_peak_bytes"] < single["method_store_peak_bytes"] and small["store_evictions"] == 0
