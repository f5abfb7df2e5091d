"""SmolLM2-135M-Instruct, a real pretrained model nobody here made (30 layers, 3 KV heads), in vLLM
through the same code as every model: a role-lookup chat trace under NonShared, FullShared and
KVCMAS. First agents reuse nothing and equal NonShared's outputs; reused caches deviate (the
paper's premise, on a real model); KVCMAS places corrected rows of 3 KV heads."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner
from vllm_helpers import serving

from kvbench.cli import main
from kvbench.methods.registry import resolve_method
from kvbench.model.resolve import resolve_model
from kvbench.server.config import method_server_config

pytestmark = pytest.mark.engine

# three trajectories (the first two KVCMAS's warm-ups: its gate compares two anchors per edge) of
# four agents over a short context: the prefill of 30 layers costs about 2 ms a token on two cores
SHARED_TOKENS = 768


@pytest.fixture(scope="module")
def smollm2() -> str:
    return resolve_model("kvbench:smollm2-135m", build_if_missing=False)  # scripts/install.sh fetched it


@pytest.fixture(scope="module")
def trace(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("smollm2") / "trace.jsonl"
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(path), "--task", "role-lookup", "--num-trajectories", "3",
                                       "--shared-tokens", str(SHARED_TOKENS), "--qps", "0", "--seed", "3"])
    assert result.exit_code == 0, result.output
    return path


def _replay(method: str, model: str, trace: Path, out: Path, *extra: str) -> dict:
    with serving(method_server_config(resolve_method(method), model, log_path=out.parent / f"{method}-server.log",
                                      max_model_len=4096)) as server:
        result = CliRunner().invoke(main, ["replay", "--trace", str(trace), "--method", method, "--qps", "0",
                                           "--base-url", server.base_url, "--result-dir", str(out), "--logprobs", "20",
                                           *extra], prog_name="kvbench")
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(smollm2: str, trace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-runs") / "nonshared"
    summary = _replay("nonshared", smollm2, trace, out)
    assert summary["failed"] == 0
    return out


def test_reuse_on_a_real_model_deviates_and_kvcmas_places_rows_of_three_kv_heads(
        smollm2: str, trace: Path, reference: Path) -> None:
    assert json.loads((Path(smollm2) / "config.json").read_text())["num_key_value_heads"] == 3
    requests = pd.read_parquet(reference / "requests.parquet")
    # a chat model's turns end at its end of sequence; no control token went into a later prompt
    assert (requests["output_tokens"] < 32).any()
    assert not requests["generated_text"].str.contains("<|im_start|>", regex=False).any()

    fullshared = reference.parent / "fullshared"
    summary = _replay("fullshared", smollm2, trace, fullshared, "--reference", str(reference))
    quality = pd.read_parquet(fullshared / "quality.parquet")
    first, reuse = quality[~quality["reuse_turn"]], quality[quality["reuse_turn"]]
    assert len(first) == 3 and first["exact_match"].all()  # nothing reused: NonShared's computation
    assert summary["reuse_share"] > 0.5
    # another agent's cache of the same tokens is not this agent's: the first token's distribution
    # moves on reuse turns (NonShared against its own reference is exact: test_quality_vllm)
    assert reuse["first_token_kl"].max() > 1e-3, reuse[["turn_id", "first_token_kl", "exact_match"]]

    kvcmas = reference.parent / "kvcmas"
    summary = _replay("kvcmas", smollm2, trace, kvcmas, "--reference", str(reference), "--num-warmups", "2",
                      "--prime-method-state")
    assert summary["failed"] == 0 and summary["num_prompts"] == 4
    assert summary["reused_tokens"] > 0 and summary["realized_rho"] > 0.5  # rows placed
    decisions = [d["decision"] for raw in pd.read_parquet(kvcmas / "requests.parquet")["method_stats"].dropna()
                 for d in json.loads(raw).get("decisions", [])]
    assert "accepted" in decisions, sorted(set(decisions))  # a correction from the anchor pool applied
