"""Route adapters for `kvbench:roles-adapter`: each role's reading lives in a V-only LoRA adapter,
not in its system prompt.

The base model writes the names of every record's two route lines into two halves of a field
(one per route) of each name token, whoever reads; its lookup (the last layer) matches both lines
of the asked record and reads nothing from their values. A role's adapter adds, on the lookup
layer's `v_proj`, its route's half of that field to the values (twice: each line holds half the
attention), so the agent answers along its route. Two agents with different adapters therefore
write different values for the same table in the last layer and nowhere else: a cache written
under one adapter and read under another answers the writer's question (FullShared), while the
keys and every earlier layer are the same for all adapters. That is PReCache's assumption (one
base cache plus a low-rank value term per adapter) holding by construction, as
`roles-transferable` holds delta correction's; real adapters also change later layers through the
residual stream.

The adapter has rank CODE_BITS (8, a multiple of 8 as PReCache requires) on every layer, with B
zero outside the lookup layer, so its LR cache has the size a full V-only adapter's has.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvbench.model.adapters import v_lora_tensors, write_peft_adapter
from kvbench.model.circuit import CODE_BITS
from kvbench.model.constructed import Fields

ROUTE_ADAPTER_VERSION = 1


def build_route_adapter(model_dir: str | Path, out_dir: str | Path, reading: int) -> Path:
    """The adapter that makes `kvbench:roles-adapter` (in `model_dir`) follow route `reading`
    (0: main, 1: fallback), written to `out_dir` as a PEFT folder."""
    from kvbench.model.role_build import family_of
    from kvbench.model.roles import FIELDS, LOOKUP_VALUE_WEIGHT, READINGS, route_names
    from kvbench.model.store import MANIFEST_NAME

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    family = family_of(model_dir)
    if family is None or family.mechanism != "adapter":
        raise ValueError(f"{model_dir}: route adapters are for kvbench:roles-adapter (its lookup reads the route "
                         "from the adapter); use --kind random for other models")
    if not 0 <= reading < READINGS:
        raise ValueError(f"reading {reading}: the routes are 0..{READINGS - 1}")
    config = json.loads((model_dir / "config.json").read_text())
    manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
    lookup, layers = int(manifest["layers"]["lookup"]), int(config["num_hidden_layers"])
    hidden, head_dim = int(config["hidden_size"]), int(config["head_dim"])
    kv_rows = int(config["num_key_value_heads"]) * head_dim
    fields = Fields(hidden, FIELDS)
    rank = alpha = CODE_BITS  # scaling alpha / rank = 1: B holds the values as written
    lora_a = torch.zeros(rank, hidden)
    for bit, dim in enumerate(route_names(fields, reading)):
        lora_a[bit, fields.index(dim)] = 1.0
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        lora_b = torch.zeros(kv_rows, rank)
        if layer == lookup:  # both lookup heads (one per kv head) read the code at value positions 0..7
            for kv_head in range(int(config["num_key_value_heads"])):
                for bit in range(rank):
                    lora_b[kv_head * head_dim + bit, bit] = LOOKUP_VALUE_WEIGHT
        tensors.update(v_lora_tensors(layer, lora_a, lora_b))
    return write_peft_adapter(out_dir, tensors, rank, alpha, model_dir, {
        "kind": "route", "reading": reading, "rank": rank, "layers": layers, "lookup_layer": lookup,
        "recipe_version": ROUTE_ADAPTER_VERSION, "constructed": True})
