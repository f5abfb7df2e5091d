"""The realism figures' pieces (`kvbench model check`), on a small random Llama: no model build."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbench.model.realism import (
    SINK_QUERIES,
    attention_sink_probe,
    effective_rank,
    loss_by_position,
    repeated_ngram_share,
    token_losses,
)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def test_the_sink_probe_reads_the_attention_the_model_computes(model: LlamaForCausalLM) -> None:
    ids = torch.randint(0, 97, (1, 300))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
        plain = model(input_ids=ids).logits
    with attention_sink_probe(model) as sinks, torch.no_grad():
        probed = model(input_ids=ids).logits
    assert model.config._attn_implementation == "eager"  # restored
    torch.testing.assert_close(probed, plain, atol=1e-4, rtol=1e-4)  # the probe leaves the output alone
    for layer, weights in enumerate(attentions):
        expected = float(weights[0, :, -SINK_QUERIES:, 0].mean())
        assert sinks[layer] == pytest.approx(expected, rel=1e-4)


def test_token_losses_match_the_models_own_loss(model: LlamaForCausalLM) -> None:
    ids = torch.randint(0, 97, (1, 200))
    with torch.no_grad():
        reference = float(model(input_ids=ids, labels=ids).loss)
    losses = token_losses(model, ids[0].tolist(), chunk=64)  # chunks of the LM head add up
    assert len(losses) == 199 and float(losses.mean()) == pytest.approx(reference, rel=1e-5)
    buckets = loss_by_position([losses, losses[:100]])
    assert set(buckets) == {"0-256"}  # windows that do not reach a bucket leave it out
    assert buckets["0-256"] == pytest.approx(float(torch.cat([losses, losses[:100]]).mean()))


def test_effective_rank_counts_the_directions_holding_the_energy() -> None:
    torch.manual_seed(1)
    basis = torch.linalg.qr(torch.randn(50, 50))[0]
    matrix = basis[:, :3] @ torch.diag(torch.tensor([10.0, 3.0, 1.0])) @ basis[:, :3].T
    assert effective_rank(matrix, 0.9) == 1  # 100 / 110 of the energy in the first direction
    assert effective_rank(matrix, 0.95) == 2 and effective_rank(matrix, 0.999) == 3


def test_repeated_ngrams() -> None:
    assert repeated_ngram_share([5] * 12, n=4) == pytest.approx(8 / 9)  # a loop
    assert repeated_ngram_share(list(range(12)), n=4) == 0.0
    assert math.isnan(repeated_ngram_share([1, 2], n=4))


def test_model_check_offline_figures_of_the_embedded_model(default_model: str, tmp_path) -> None:
    """`kvbench model check --no-serving` end to end (transformers only; the vLLM figures come from
    sweeps, tested on their own)."""
    import json

    from click.testing import CliRunner

    from kvbench.cli import main

    result = CliRunner().invoke(main, ["model", "check", "--no-serving", "--json", "--loss-window", "1024",
                                       "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "check.json").read_text())
    config = json.loads((Path(default_model) / "config.json").read_text())
    assert figures["model"] == Path(default_model).name and len(figures["weights_sha256"]) == 64
    assert set(figures["heldout_loss_by_position"]) == {"0-256", "256-2048"}  # a 1K window reaches two buckets
    assert all(2.0 < v < 9.0 for v in figures["heldout_loss_by_position"].values())  # between memorized and uniform
    assert len(figures["attention_sink_share_by_layer"]) == config["num_hidden_layers"]
    assert 0 <= figures["attention_sink_share_later_layers"] <= 1
    kv_dims = config["num_key_value_heads"] * config["head_dim"]
    assert 1 <= figures["value_delta_effective_rank_90"] <= figures["value_delta_dims"] == kv_dims
    assert "recall_accuracy" not in figures
