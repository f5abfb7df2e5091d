"""PolyKV inside vLLM on the embedded model: end to end, and with an identity codec equal to FullShared
(`kvbench check`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from vllm_helpers import all_passed, method_check, serving

from kvbench.cli import main
from kvbench.methods.registry import resolve_method
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer
from kvbench.server.worker_rpc import WorkerClient

pytestmark = pytest.mark.engine

TRACE = ["--qps", "0", "--num-trajectories", "2", "--shared-tokens", "1024", "--output-len", "16"]


@pytest.fixture(scope="module")
def polykv_server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    config = method_server_config(resolve_method("polykv"), default_model, max_model_len=4096,
                                  log_path=Path(tmp_path_factory.mktemp("polykv")) / "server.log")
    with serving(config) as server:
        yield server


def _replay(server: VLLMServer, method: str, out: Path) -> tuple[pd.DataFrame, dict]:
    result = CliRunner().invoke(main, ["replay", "--method", method, "--base-url", server.base_url, *TRACE,
                                       "--result-dir", str(out)], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    return pd.read_parquet(out / "requests.parquet"), json.loads((out / "summary.json").read_text())


def test_polykv_replays_from_a_compressed_store(polykv_server: VLLMServer, default_model: str,
                                                tmp_path: Path) -> None:
    requests, summary = _replay(polykv_server, "polykv", tmp_path / "polykv")
    assert requests["success"].all() and summary["realized_rho"] > 0.9
    config = json.loads((Path(default_model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bf16 = config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 2 + 8  # K, V, token id
    # int8 keys and 3-bit values with their norms and scales, measured from the tensors held
    assert bf16 / summary["store_bytes_per_token"] > 2.5
    assert summary["store_decode_ms_per_1k_tokens"] > 0 and summary["store_encode_ms_per_1k_tokens"] > 0


def test_with_an_identity_codec_it_places_fullshareds_kv(polykv_server: VLLMServer, fullshared_server: VLLMServer,
                                                         tmp_path: Path) -> None:
    """`kvbench check`: the identity codec gives FullShared's placed K/V bit for bit, and its outputs."""
    report = method_check(tmp_path, "polykv", polykv_server, fullshared_server)
    assert all_passed(report), report["outcomes"]
    assert report["outcomes"][0]["details"]["max_relative_difference"] == 0.0
    assert WorkerClient(polykv_server.base_url).info()[0].params["store_codec"] == "polykv"  # left as it was
