"""PEFT adapter folders written by hand here (not by kvbench's builder): the value term the
connector adds is (alpha / r) X A^T B^T with the folder's own alpha and r, computed here with
plain torch; and `gen-trace --adapter` refuses folders kvbench cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from kvbench.cli import main
from kvbench.methods.core.lora import load_v_lora

LAYERS, HIDDEN, KV_ROWS = 2, 12, 8


def _peft(folder: Path, rank: int, alpha: float, modules: tuple[str, ...] = ("v_proj",), seed: int = 0,
          tensor_rank: int | None = None) -> dict[str, torch.Tensor]:
    """A PEFT LoRA folder with PEFT's own tensor names; returns its float32 tensors."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            r = tensor_rank or rank
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, HIDDEN, generator=generator).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(KV_ROWS, r, generator=generator).to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules)}))
    return {name: t.float() for name, t in tensors.items()}


@pytest.mark.parametrize("rank, alpha", [(4, 12), (8, 4), (4, 4)])
def test_the_value_term_is_scaled_by_the_folders_alpha_over_r(tmp_path: Path, rank: int, alpha: float) -> None:
    tensors = _peft(tmp_path / "a", rank, alpha)
    lora = load_v_lora("a", tmp_path / "a", LAYERS, slice(0, KV_ROWS), dtype=torch.float32)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for layer in range(LAYERS):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.v_proj"
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        expected = (alpha / rank) * (x @ a.T) @ b.T  # PEFT's definition, computed here
        assert torch.allclose(lora.value_term(layer, lora.low_rank(layer, x)), expected, rtol=1e-4, atol=1e-4)


def test_a_rank_split_keeps_only_this_ranks_value_rows(tmp_path: Path) -> None:
    tensors = _peft(tmp_path / "a", 4, 8)
    lora = load_v_lora("a", tmp_path / "a", LAYERS, slice(4, 8), dtype=torch.float32)
    b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert torch.equal(lora.b[1], b[4:8])


def _gen_trace(tmp_path: Path, folder: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["gen-trace", "-o", str(tmp_path / "t.jsonl"), "--num-trajectories", "1",
                                       "--shared-tokens", "64", "--adapter", f"Math Solver={folder}"])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def test_gen_trace_takes_a_v_only_adapter(tmp_path: Path) -> None:
    _peft(tmp_path / "good", 4, 8)
    code, output = _gen_trace(tmp_path, tmp_path / "good")
    assert code == 0, output


@pytest.mark.parametrize("damage, said", [
    ("corrupt", "not readable safetensors"),
    ("q_proj", "target_modules"),
    ("rank", "not of the rank r=8"),
    ("alpha", "lora_alpha must be a number"),
])
def test_gen_trace_refuses_adapters_kvbench_cannot_serve(tmp_path: Path, damage: str, said: str) -> None:
    folder = tmp_path / damage
    if damage == "q_proj":
        _peft(folder, 4, 8, modules=("q_proj", "v_proj"))
    elif damage == "rank":
        _peft(folder, 8, 8, tensor_rank=4)  # the config says 8, the tensors are rank 4
    else:
        _peft(folder, 4, 8)
    if damage == "corrupt":
        (folder / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    if damage == "alpha":
        (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["v_proj"]}))
    code, output = _gen_trace(tmp_path, folder)
    assert code != 0 and said in output, output
    assert not (tmp_path / "t.jsonl").exists()
