"""PEFT LoRA folders for tests that only need an adapter kvbench accepts (V-only, of its rank)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def v_only_peft(folder: Path, rank: int = 8) -> Path:
    """One layer's v_proj A and B (zeros: the identity adapter), under PEFT's names."""
    folder.mkdir(parents=True)
    prefix = "base_model.model.model.layers.0.self_attn.v_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(rank, 8), f"{prefix}.lora_B.weight": torch.zeros(4, rank)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "peft_type": "LORA",
                                                            "target_modules": ["v_proj"]}))
    return folder
