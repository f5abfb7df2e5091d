"""Quality against a NonShared reference, on the embedded model in vLLM: the noise floor is zero
where nothing changes, dense fallback changes nothing, and naive reuse changes outputs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from vllm_helpers import serving

from kvbench.cli import main
from kvbench.methods.registry import resolve_method
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer

pytestmark = pytest.mark.engine

TRACE = ["--shared-tokens", "2048", "--output-len", "32", "--num-trajectories", "3", "--qps", "0"]


def _replay(server: VLLMServer, method: str, out: Path, *extra: str) -> dict:
    result = CliRunner().invoke(main, ["replay", "--method", method, "--base-url", server.base_url, *TRACE,
                                       "--result-dir", str(out), *extra], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A free-running NonShared run with first-token logprobs: what the others are compared with."""
    out = tmp_path_factory.mktemp("quality") / "reference"
    _replay(vllm_server, "nonshared", out, "--logprobs", "20")
    return out


@pytest.fixture(scope="module")
def always_faulty_server(default_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """FullShared whose every load fails: vLLM computes every prompt itself (dense fallback)."""
    config = method_server_config(resolve_method("fullshared"), default_model, fault_injection="all", max_model_len=4096,
                                  log_path=Path(tmp_path_factory.mktemp("faulty")) / "server.log")
    with serving(config) as server:
        yield server


def test_nonshared_against_its_own_reference_is_exact_and_pgr_one(vllm_server: VLLMServer, reference: Path,
                                                                   tmp_path: Path) -> None:
    anchored = _replay(vllm_server, "nonshared", tmp_path / "again", "--reference", str(reference))
    assert anchored["exact_match_rate"] == 1.0 and anchored["top1_agreement"] == 1.0
    assert anchored["mean_first_token_kl"] == pytest.approx(0.0, abs=1e-6)
    _replay(vllm_server, "nonshared", tmp_path / "floor", "--drop-shared")
    result = CliRunner().invoke(main, ["quality", str(tmp_path / "again"), str(tmp_path / "floor"),
                                       "--reference", str(reference), "--floor", str(tmp_path / "floor")])
    assert result.exit_code == 0, result.output
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    floor = json.loads((tmp_path / "floor" / "summary.json").read_text())
    assert floor["mean_token_f1"] < 0.9  # the shared context changes this model's outputs...
    assert again["output_pgr"] == pytest.approx(1.0) and floor["output_pgr"] == pytest.approx(0.0)  # ...so PGR is defined


def test_dense_fallback_on_every_load_matches_the_reference(always_faulty_server: VLLMServer, reference: Path,
                                                            tmp_path: Path) -> None:
    summary = _replay(always_faulty_server, "fullshared", tmp_path / "faulty", "--reference", str(reference))
    assert summary["exact_match_rate"] == 1.0 and summary["realized_rho"] == 0.0


def test_naive_reuse_changes_outputs_and_it_shows(fullshared_server: VLLMServer, reference: Path,
                                                  tmp_path: Path) -> None:
    """FullShared at 2K, reference-anchored: some reuse turn's output differs from the reference,
    the comparison finds it, and the reuse turns' first-token distributions moved further than
    the first agents' (computed by the connector's partial forward: the same up to numerics)."""
    summary = _replay(fullshared_server, "fullshared", tmp_path / "fs", "--reference", str(reference))
    assert summary["realized_rho"] > 0.9
    assert summary["exact_match_rate_reuse"] < 1.0
    assert summary["mean_first_token_kl_reuse"] > summary["mean_first_token_kl_first"]
