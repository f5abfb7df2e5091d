"""A saved cache as bytes for the shared tier, and back: safetensors (tensors, no pickle: a value
from the store is never executed) with a header naming what it is. The bytes are the store's
entry as kept (a codec's encoding included), so an instance that reads it holds what the writer
held; a value from another model, codec or kvbench layout, or one that does not parse, is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from kvbench.methods.core.kv_codec import Encoded, KVCodec
from kvbench.methods.core.store import CompressedKV, SavedKV

LAYOUT = "kvbench-entry-1"


class EntryError(ValueError):
    """Bytes that are not an entry this reader may place (it then computes the rows densely)."""


@dataclass(frozen=True)
class EntryShape:
    """What an entry this reader may place holds: its layers, this rank's KV heads, their size
    and the dtype its caches keep (as its own saves do)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`: its largest magnitude is finite (max propagates both), a
    sixth of torch.isfinite(...).all()'s time on a 34 MB bf16 entry on one CPU core."""
    return tensor.numel() == 0 or bool(torch.isfinite(tensor.abs().amax()))


def check_entry(entry: SavedKV | CompressedKV, expect: EntryShape) -> None:
    """EntryError unless `entry` fits this reader's model: K and V [layers, n, heads, head_dim] of
    its dtype and finite, one integer token id per row, exact rows within them, a hidden stream
    (where there is one) with a row each and finite. Whatever another writer put in the store,
    only this is placed."""
    ids = entry.token_ids
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or (len(ids) and int(ids.min()) < 0):
        raise EntryError(f"token ids {tuple(ids.shape)} {ids.dtype}: not one non-negative integer per row")
    n = len(ids)
    wanted = (expect.layers, n, expect.kv_heads, expect.head_dim)
    for name, part in (("K", entry.k), ("V", entry.v)):
        shape, dtype = (tuple(part.shape), part.dtype)
        if shape != wanted or dtype != expect.dtype:
            raise EntryError(f"{name} is {shape} {dtype}, this model's caches take {wanted} {expect.dtype}")
        if isinstance(part, torch.Tensor) and not all_finite(part):
            raise EntryError(f"{name} holds values that are not finite")
    exact = getattr(entry, "exact_rows", 0)
    if not isinstance(exact, int) or not 0 <= exact <= n:
        raise EntryError(f"exact_rows {exact!r} outside 0..{n}")
    if entry.hidden is not None:
        valid = entry.hidden_valid
        if (entry.hidden.dim() != 2 or entry.hidden.shape[0] != n or valid is None or valid.shape != (n,)
                or valid.dtype != torch.bool or not all_finite(entry.hidden)):
            raise EntryError(f"hidden stream {tuple(entry.hidden.shape)} does not fit {n} rows")


def _encoded_tensors(prefix: str, encoded: Encoded) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {f"{prefix}.{name}": t.contiguous() for name, t in encoded.tensors.items()}
    return tensors, {"shape": list(encoded.shape), "dtype": str(encoded.dtype).removeprefix("torch."),
                     "meta": encoded.meta, "names": sorted(encoded.tensors)}


def entry_to_bytes(entry: SavedKV | CompressedKV, model: str) -> bytes:
    compressed = isinstance(entry, CompressedKV)
    header: dict[str, Any] = {"layout": LAYOUT, "model": model, "hidden_layer": entry.hidden_layer,
                              "codec": entry.codec.name if isinstance(entry, CompressedKV) else None,
                              "exact_rows": 0 if compressed else entry.exact_rows}
    tensors: dict[str, torch.Tensor] = {"token_ids": entry.token_ids.contiguous()}
    if isinstance(entry, CompressedKV):
        for prefix, encoded in (("k", entry.k), ("v", entry.v)):
            part, header[prefix] = _encoded_tensors(prefix, encoded)
            tensors.update(part)
    else:
        tensors.update(k=entry.k.contiguous(), v=entry.v.contiguous())
    if entry.hidden is not None and entry.hidden_valid is not None:
        tensors.update(hidden=entry.hidden.contiguous(), hidden_valid=entry.hidden_valid.contiguous())
    return save_tensors({name: t.cpu() for name, t in tensors.items()}, metadata={"kvbench": json.dumps(header)})


def _encoded(prefix: str, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> Encoded:
    part = header[prefix]
    return Encoded({name: tensors[f"{prefix}.{name}"] for name in part["names"]}, tuple(part["shape"]),
                   getattr(torch, part["dtype"]), dict(part["meta"]))


def entry_from_bytes(value: bytes, model: str, codec: KVCodec | None, device: torch.device | str = "cpu",
                     expect: EntryShape | None = None) -> SavedKV | CompressedKV:
    """The entry `value` holds, on `device`; EntryError when it is not one this reader (its model,
    its store's codec and, given `expect`, its caches' shapes: check_entry) may place."""
    try:
        tensors = load_tensors(value)
        header = json.loads(_metadata(value)["kvbench"])
    except (SafetensorError, ValueError, KeyError, TypeError, AttributeError) as exc:  # (bad JSON: a ValueError)
        raise EntryError(f"not a kvbench entry ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise EntryError(f"not a kvbench entry (its header is a JSON {type(header).__name__})")
    if header.get("layout") != LAYOUT:
        raise EntryError(f"entry layout {header.get('layout')!r}, this kvbench reads {LAYOUT}")
    if header.get("model") != model:
        raise EntryError(f"entry written by model {header.get('model')!r}, this server runs {model!r}")
    wanted = None if codec is None else codec.name
    if header.get("codec") != wanted:
        raise EntryError(f"entry kept with codec {header.get('codec')!r}, this store keeps {wanted!r}")
    try:
        # token ids and the hidden-row mask stay on the CPU, as a save keeps them; the rest on `device`
        tensors = {name: t if name in ("token_ids", "hidden_valid") else t.to(device) for name, t in tensors.items()}
        hidden, valid = tensors.get("hidden"), tensors.get("hidden_valid")
        entry: SavedKV | CompressedKV
        if codec is not None:
            entry = CompressedKV(tensors["token_ids"], _encoded("k", tensors, header), _encoded("v", tensors, header),
                                 codec, hidden, valid, header.get("hidden_layer"))
        else:
            entry = SavedKV(tensors["token_ids"], tensors["k"], tensors["v"], hidden, valid,
                            header.get("hidden_layer"), exact_rows=int(header.get("exact_rows") or 0))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
        raise EntryError(f"entry incomplete ({type(exc).__name__}: {exc})") from None
    if expect is not None:
        check_entry(entry, expect)
    elif isinstance(entry, SavedKV) and (entry.k.dim() != 4 or entry.k.shape != entry.v.shape
                                         or entry.k.shape[1] != len(entry.token_ids)
                                         or not 0 <= entry.exact_rows <= len(entry.token_ids)):
        raise EntryError(f"entry shapes disagree: K {tuple(entry.k.shape)}, V {tuple(entry.v.shape)}, "
                         f"{len(entry.token_ids)} tokens, {entry.exact_rows} exact rows")
    return entry


def _metadata(value: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (the format: an 8-byte little-endian length, then JSON)."""
    length = int.from_bytes(value[:8], "little")
    return json.loads(value[8:8 + length])["__metadata__"]
