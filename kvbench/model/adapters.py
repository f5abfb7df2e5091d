"""LoRA adapters as PEFT folders vLLM loads (`--lora-modules name=path`), and PReCache's rule that
an adapter touch only the value projection.

`build_random_adapter` writes a seeded V-only adapter for a Llama-architecture model: A and B
drawn from a fixed generator, B scaled so the adapter moves each layer's values by a set share
of their size (`strength`), or B zero (the identity adapter: outputs equal the base model's). It
is a stand-in for a fine-tuned role adapter: it changes what an agent writes into its cache and
what it answers, deterministically, but encodes no role; what a trained or constructed adapter
adds is which answers change.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
MANIFEST = "kvbench-adapter.json"
V_PROJ = "v_proj"


def _config(model_dir: Path) -> dict[str, Any]:
    """The model's config.json: from its folder, else through transformers (a hub name)."""
    if (model_dir / "config.json").is_file():
        return dict(json.loads((model_dir / "config.json").read_text()))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    return dict((getattr(config, "text_config", None) or config).to_dict())


def build_random_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = 8, seed: int = 0,
                         strength: float = 0.5, zero: bool = False) -> Path:
    """A V-only LoRA adapter of `rank` on every layer of the model in `model_dir`, written to
    `out_dir` (PEFT format, with a manifest recording how it was made and its weights' sha256)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = _config(model_dir)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    kv_dim = int(config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim
    layers = int(config["num_hidden_layers"])
    alpha = 2 * rank
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        # x @ A^T has about unit entries per coordinate for unit-variance inputs: B's scale then sets
        # the update's size against the values' (strength, per output coordinate)
        lora_a = torch.randn(rank, hidden, generator=generator) / hidden ** 0.5
        lora_b = torch.randn(kv_dim, rank, generator=generator) * (strength / rank ** 0.5) * (rank / alpha)
        tensors.update(v_lora_tensors(layer, lora_a, torch.zeros_like(lora_b) if zero else lora_b))
    return write_peft_adapter(out_dir, tensors, rank, alpha, model_dir, {
        "kind": "zero" if zero else "random", "rank": rank, "seed": seed, "strength": strength, "layers": layers})


def _v_lora_names(layer: int) -> tuple[str, str]:
    """PEFT's tensor names of one layer's v_proj LoRA A and B."""
    prefix = f"base_model.model.model.layers.{layer}.self_attn.{V_PROJ}"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


def v_lora_tensors(layer: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's v_proj LoRA under PEFT's names: A [rank, hidden], B [kv rows, rank] (bf16)."""
    name_a, name_b = _v_lora_names(layer)
    return {name_a: lora_a.to(torch.bfloat16).contiguous(), name_b: lora_b.to(torch.bfloat16).contiguous()}


def read_v_lora(folder: str | Path, num_layers: int) -> tuple[int, float, list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """A PEFT adapter's rank, scaling (alpha / r) and each layer's v_proj (A, B), None where it
    leaves the layer alone. Raises OSError/ValueError for a folder it cannot read, or whose
    tensors' rank is not its config's."""
    folder = Path(folder)
    rank, alpha = _declared_rank(folder)
    tensors = _load_weights(folder)
    layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for layer in range(num_layers):
        name_a, name_b = _v_lora_names(layer)
        layers.append((tensors[name_a], tensors[name_b]) if name_a in tensors and name_b in tensors else None)
    for layer, weights in enumerate(layers):
        if weights is not None and (weights[0].shape[0] != rank or weights[1].shape[-1] != rank):
            raise ValueError(f"{folder}: layer {layer}'s v_proj A {tuple(weights[0].shape)} / B {tuple(weights[1].shape)} "
                             f"are not of the rank r={rank} its {PEFT_CONFIG} declares")
    return rank, alpha / rank, layers


def _declared_rank(folder: Path) -> tuple[int, float]:
    """The config's rank r and lora_alpha; ValueError when missing or not numbers."""
    try:
        config = json.loads((folder / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder}: no readable {PEFT_CONFIG} ({exc})") from None
    rank, alpha = (config.get("r"), config.get("lora_alpha")) if isinstance(config, dict) else (None, None)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{folder / PEFT_CONFIG}: r must be a rank >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{folder / PEFT_CONFIG}: lora_alpha must be a number > 0, got {alpha!r}")
    return rank, float(alpha)


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(folder / PEFT_WEIGHTS))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
        raise ValueError(f"{folder / PEFT_WEIGHTS}: not readable safetensors ({exc})") from None


def adapter_problems(folder: str | Path) -> list[str]:
    """Why kvbench cannot serve the PEFT folder as an agent's adapter: its config or weights
    unreadable, not V-only (PReCache's rule, which kvbench's connector also needs), no v_proj
    weights, or tensors of another rank than the config declares."""
    folder = Path(folder)
    try:
        names = list(_load_weights(folder))
        layers = [int(m.group(1)) for name in names if (m := re.search(r"\.layers\.(\d+)\.", name))]
        read_v_lora(folder, max(layers, default=-1) + 1)
        problems = v_only_problems(folder)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    if not any(name.endswith(".lora_A.weight") and f".{V_PROJ}." in name for name in names):
        problems.append(f"{folder}: no {V_PROJ} LoRA weights")
    return problems


def write_peft_adapter(out_dir: Path, tensors: dict[str, torch.Tensor], rank: int, alpha: int, model_dir: Path,
                       manifest: dict[str, Any]) -> Path:
    """A V-only LoRA adapter folder: weights, PEFT config, and kvbench's manifest (how it was
    made, with the weights' sha256)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / PEFT_WEIGHTS))
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
                   "target_modules": [V_PROJ], "bias": "none", "fan_in_fan_out": False,
                   "base_model_name_or_path": str(model_dir)}
    (out_dir / PEFT_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    (out_dir / MANIFEST).write_text(json.dumps({**manifest, "weights_sha256": weights_sha256(out_dir)}, indent=2) + "\n")
    return out_dir


def weights_sha256(folder: str | Path) -> str:
    """Over tensor names, dtypes, shapes and bytes (not the file: safetensors' header order may vary)."""
    tensors = load_file(str(Path(folder) / PEFT_WEIGHTS))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def v_only_problems(folder: str | Path) -> list[str]:
    """Why an adapter is not V-only (PReCache keeps one base cache of keys and base values, so an
    adapter may change only the values): its config's targets and its tensors' modules."""
    folder = Path(folder)
    problems = []
    config = json.loads((folder / PEFT_CONFIG).read_text())
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if set(targets) != {V_PROJ}:
        problems.append(f"{folder}: target_modules {targets} (PReCache needs exactly ['{V_PROJ}'])")
    weights = folder / PEFT_WEIGHTS
    if weights.exists():
        others = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in _load_weights(folder)} - {V_PROJ})
        if others:
            problems.append(f"{folder}: weights for {', '.join(others)} (only {V_PROJ} is allowed)")
    return problems


def merge_v_lora(model: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """`model` (a transformers Llama) with the V-only adapter in `folder` merged into its value
    projections (W_v + (alpha / r) B A), in place: what vLLM computes for a request naming it."""
    _, scaling, layers = read_v_lora(folder, len(model.model.layers))
    with torch.no_grad():
        for layer, weights in zip(model.model.layers, layers):
            if weights is not None:
                a, b = (t.float() for t in weights)
                weight = layer.self_attn.v_proj.weight
                weight.add_((scaling * b @ a).to(weight.dtype))
    return model
