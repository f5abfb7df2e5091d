"""Fixtures of the engine tier's tests only (the shared ones, servers included, are in
tests/conftest.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_layers(default_model: str) -> int:
    """Decoder layers of the embedded default model."""
    return int(json.loads((Path(default_model) / "config.json").read_text())["num_hidden_layers"])


@pytest.fixture(scope="session")
def context_layer(default_model: str) -> int:
    """The embedded model's first context-dependent layer: CacheBlend's check layer and
    RelayCaching's detection layer by default."""
    from kvbench.model.store import first_context_layer

    return first_context_layer(default_model)


@pytest.fixture(scope="session")
def bf16_noise(default_model: str, prompts: dict) -> dict[str, float]:
    """Log-prob tolerance per prompt: 0.02, or one bf16 step of the largest next-token logit if
    that is coarser. vLLM computes logits in bf16, so a single logit rounding the other way moves
    log-probs by one step: 1/32 for logits in [4, 8). (0.02 came from a random-weight model whose
    logits are small; the trained embedded model's are not.)"""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    tolerance = {}
    for name in ("p0", "p1"):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompts[name]])).logits[0, -1]
        step = 2.0 ** (math.floor(math.log2(float(logits.abs().max()))) - 7)
        tolerance[name] = max(0.02, step + 0.002)
    return tolerance
