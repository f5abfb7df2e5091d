"""The embedded model builds deterministically, and its artefacts are what transformers expects."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvbench.model.build import build_model, weights_sha256
from kvbench.model.spec import TinyModelSpec
from kvbench.model.store import MANIFEST_NAME

# Two training steps exercise the whole recipe (corpus, tokenizer, init, AdamW, save) in seconds.
QUICK = TinyModelSpec().with_overrides(train_steps=2)


@pytest.fixture(scope="module")
def quick_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("models")
    builds = {}
    for name, seed in [("a", 7), ("b", 7), ("c", 8)]:
        builds[name] = build_model(QUICK, seed, root / name, show_progress=False)
        builds[name]["dir"] = root / name
    return builds


@pytest.mark.engine  # trains models (two steps each, but the tokenizer and corpus too)
def test_same_seed_gives_identical_weights(quick_builds: dict[str, dict]) -> None:
    assert quick_builds["a"]["weights_sha256"] == quick_builds["b"]["weights_sha256"]


@pytest.mark.engine  # trains models (two steps each, but the tokenizer and corpus too)
def test_different_seed_gives_different_weights(quick_builds: dict[str, dict]) -> None:
    assert quick_builds["a"]["weights_sha256"] != quick_builds["c"]["weights_sha256"]


@pytest.mark.engine  # trains models (two steps each, but the tokenizer and corpus too)
def test_manifest_hash_matches_saved_file(quick_builds: dict[str, dict]) -> None:
    from safetensors.torch import load_file

    model_dir = quick_builds["a"]["dir"]
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    state = load_file(str(model_dir / "model.safetensors"))
    assert weights_sha256(state) == manifest["weights_sha256"]
    assert all(t.dtype == torch.bfloat16 for t in state.values())


def test_default_model_loads_in_transformers_and_trained(default_model: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = json.loads((Path(default_model) / MANIFEST_NAME).read_text())
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    text = "def read_file(path):\n    with open(path) as f:\n        return f.read()\n"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text  # byte-level BPE round-trips
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # Trained: far below the uniform-guess loss ln(vocab) (8.3 nats for 4096 tokens, 9.0 for 8192).
    uniform = math.log(model.config.vocab_size)
    assert manifest["heldout_loss"] < uniform - 2.0
    assert loss < uniform - 2.0


def test_spec_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="unknown model spec field"):
        TinyModelSpec().with_overrides(layers=3)
