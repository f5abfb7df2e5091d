"""Whether a served model's decoder layers are the Llama layer the connector's partial forward
re-implements (methods/core/forward.py): checked when the model is attached, so that a model the
connector would compute wrongly is refused at server start, naming what it does not support."""

from __future__ import annotations

from typing import Any

# What the partial forward calls, by the names vLLM's Llama-family models give them.
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
ATTENTION_PARTS = ("qkv_proj", "o_proj", "rotary_emb", "attn")
# Parts other architectures add that the partial forward would skip, computing another model.
FOREIGN_PARTS = {
    "q_norm": "q/k RMSNorm inside attention",
    "k_norm": "q/k RMSNorm inside attention",
    "pre_feedforward_layernorm": "norms before and after each block",
    "post_feedforward_layernorm": "norms before and after each block",
}


class UnsupportedLayersError(RuntimeError):
    """A model whose decoder layers the connector cannot compute."""


def unsupported_features(layer: Any) -> list[str]:
    """What one decoder layer has or lacks against the Llama layer (empty: it fits)."""
    found = [f"no {part}" for part in LAYER_PARTS if not hasattr(layer, part)]
    attention = getattr(layer, "self_attn", None)
    if attention is not None:
        found += [f"no self_attn.{part}" for part in ATTENTION_PARTS if not hasattr(attention, part)]
        found += [FOREIGN_PARTS[part] for part in FOREIGN_PARTS if hasattr(attention, part)]
        window = getattr(getattr(attention, "attn", None), "sliding_window", None)
        if window:
            found.append(f"sliding-window attention ({window} tokens; the connector's attention is global)")
    found += [FOREIGN_PARTS[part] for part in FOREIGN_PARTS if hasattr(layer, part)]
    return list(dict.fromkeys(found))


def check_llama_layers(layers: list[Any], architecture: str) -> None:
    """Raise UnsupportedLayersError naming every unsupported feature (and the layers having it)."""
    by_feature: dict[str, list[int]] = {}
    for index, layer in enumerate(layers):
        for feature in unsupported_features(layer):
            by_feature.setdefault(feature, []).append(index)
    if by_feature:
        listed = "; ".join(f"{feature} (layers {_ranges(indices)})" for feature, indices in by_feature.items())
        raise UnsupportedLayersError(f"the kvbench connector cannot run {architecture}: its decoder layers are not the "
                                     f"Llama layer its partial forward computes: {listed}. NonShared (plain vLLM) "
                                     "serves it")


def _ranges(indices: list[int]) -> str:
    spans: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ", ".join(spans)
