"""An anchor as bytes for the shared tier, and back (issue 68): safetensors (no pickle: a value from
the store is never executed) with a header naming the model, the slot and what each tensor is.
Bases and corrections travel as kept: full rank, or low rank as their factors. A reader takes an
anchor only where it fits its own pool: its model, its slot, [layers, rows, features] of its own
caches (this rank's heads), finite values; anything else is an AnchorError, counted and dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from kvbench.methods.core.entry_bytes import all_finite
from kvbench.methods.delta.anchors import Anchor
from kvbench.methods.delta.stored import FullRank, LowRank, Stored

LAYOUT = "kvbench-anchor-1"
MAX_EDGES = 64  # corrections one anchor may carry (one per consumer edge of its slot)


class AnchorError(ValueError):
    """Bytes that are not an anchor this reader may add to its pool."""


@dataclass(frozen=True)
class AnchorShape:
    """What an anchor of this reader's pools holds: layers and features (this rank's KV heads x
    head size) of every base and correction."""

    layers: int
    features: int


def shareable(anchor: Anchor) -> bool:
    """Whether the anchor's bases and corrections are kinds that travel (a codec-kept base does not)."""
    parts = [anchor.base_k, anchor.base_v, *(s for pair in anchor.deltas.values() for s in pair)]
    return all(isinstance(s, FullRank | LowRank) for s in parts)


def _stored_tensors(name: str, stored: Stored) -> tuple[dict[str, torch.Tensor], str]:
    if isinstance(stored, LowRank):
        return {f"{name}.a": stored.a.contiguous().cpu(), f"{name}.b": stored.b.contiguous().cpu()}, "low_rank"
    assert isinstance(stored, FullRank)
    return {f"{name}.z": stored.z.contiguous().cpu()}, "full_rank"


def anchor_to_bytes(anchor: Anchor, slot: str, model: str) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    parts = {"base_k": anchor.base_k, "base_v": anchor.base_v}
    edges = sorted(anchor.deltas)
    for index, edge in enumerate(edges):
        parts[f"delta{index}_k"], parts[f"delta{index}_v"] = anchor.deltas[edge]
    for name, stored in parts.items():
        part, kinds[name] = _stored_tensors(name, stored)
        tensors.update(part)
    header = {"layout": LAYOUT, "model": model, "slot": slot, "anchor_id": anchor.anchor_id, "source": anchor.source,
              "edges": edges, "kinds": kinds}
    return save_tensors(tensors, metadata={"kvbench": json.dumps(header)})


def _stored(name: str, kind: Any, tensors: dict[str, torch.Tensor], expect: AnchorShape) -> Stored:
    """One base or correction, checked: [layers, n, features] of a floating dtype, finite."""
    if kind == "low_rank":
        a, b = tensors[f"{name}.a"], tensors[f"{name}.b"]
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != expect.layers or b.shape[0] != expect.layers \
                or a.shape[2] != b.shape[1] or b.shape[2] != expect.features:
            raise AnchorError(f"{name}: factors {tuple(a.shape)} x {tuple(b.shape)} do not make "
                              f"[{expect.layers}, n, {expect.features}]")
        parts = (a, b)
        stored: Stored = LowRank.from_factors(a, b)
    elif kind == "full_rank":
        z = tensors[f"{name}.z"]
        if z.dim() != 3 or z.shape[0] != expect.layers or z.shape[2] != expect.features:
            raise AnchorError(f"{name}: {tuple(z.shape)}, this model's anchors are [{expect.layers}, n, {expect.features}]")
        parts = (z,)
        stored = FullRank.__new__(FullRank)
        stored.z = z
    else:
        raise AnchorError(f"{name}: unknown kind {kind!r}")
    for tensor in parts:
        if not tensor.dtype.is_floating_point or not all_finite(tensor):
            raise AnchorError(f"{name}: {tensor.dtype} values, not all finite floats")
    return stored


def anchor_from_bytes(value: bytes, model: str, slot: str, expect: AnchorShape,
                      device: torch.device | str = "cpu") -> Anchor:
    """The anchor `value` holds, on `device`; AnchorError unless it is one of `model`'s anchors of
    `slot` that fits `expect`."""
    try:
        tensors = load_tensors(value)
        length = int.from_bytes(value[:8], "little")
        header = json.loads(json.loads(value[8:8 + length])["__metadata__"]["kvbench"])
    except (SafetensorError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AnchorError(f"not a kvbench anchor ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict) or header.get("layout") != LAYOUT:
        raise AnchorError(f"not a {LAYOUT} value")
    if header.get("model") != model:
        raise AnchorError(f"anchor of model {header.get('model')!r}, this server runs {model!r}")
    if header.get("slot") != slot:
        raise AnchorError(f"anchor of slot {header.get('slot')!r}, read as one of {slot!r}")
    edges, kinds = header.get("edges"), header.get("kinds")
    anchor_id, source = header.get("anchor_id"), header.get("source")
    if (not isinstance(edges, list) or not 0 < len(edges) <= MAX_EDGES or not all(isinstance(e, str) for e in edges)
            or not isinstance(kinds, dict) or not isinstance(anchor_id, str) or not isinstance(source, str)
            or any(e.split("->", 1)[0] != source for e in edges)):
        raise AnchorError("anchor header incomplete, or a correction from another source than its base's")
    try:
        parts = {name: _stored(name, kinds.get(name), tensors, expect)
                 for name in ("base_k", "base_v", *(f"delta{i}_{kv}" for i in range(len(edges)) for kv in "kv"))}
    except KeyError as exc:
        raise AnchorError(f"anchor incomplete (no {exc})") from None
    if parts["base_k"].length != parts["base_v"].length:
        raise AnchorError("anchor bases of different lengths")
    for stored in parts.values():
        if isinstance(stored, LowRank):
            stored.a, stored.b = stored.a.to(device), stored.b.to(device)
        else:
            assert isinstance(stored, FullRank)
            stored.z = stored.z.to(device)
    anchor = Anchor(anchor_id, source, parts["base_k"], parts["base_v"])
    anchor.deltas = {edge: (parts[f"delta{i}_k"], parts[f"delta{i}_v"]) for i, edge in enumerate(edges)}
    return anchor
