"""A saved cache as bytes for the shared tier, and back: safetensors (tensors, no pickle: a value
from the store is never executed) with a header naming what it is. The bytes are the store's
entry as kept (a codec's encoding included), so an instance that reads it holds what the writer
held; a value from another model, codec or kvbench layout, or one that does not parse, is refused.
"""

from __future__ import annotations

import json
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


def entry_from_bytes(value: bytes, model: str, codec: KVCodec | None, device: torch.device | str = "cpu"
                     ) -> SavedKV | CompressedKV:
    """The entry `value` holds, on `device`; EntryError when it is not one this reader (its model
    and its store's codec) may place."""
    try:
        tensors = load_tensors(value)
        header = json.loads(_metadata(value)["kvbench"])
    except (SafetensorError, ValueError, KeyError, TypeError) as exc:  # (a bad JSON header is a ValueError)
        raise EntryError(f"not a kvbench entry ({type(exc).__name__}: {exc})") from None
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
        if codec is not None:
            return CompressedKV(tensors["token_ids"], _encoded("k", tensors, header), _encoded("v", tensors, header),
                                codec, hidden, valid, header.get("hidden_layer"))
        entry = SavedKV(tensors["token_ids"], tensors["k"], tensors["v"], hidden, valid, header.get("hidden_layer"),
                        exact_rows=int(header.get("exact_rows") or 0))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EntryError(f"entry incomplete ({type(exc).__name__}: {exc})") from None
    if entry.k.shape != entry.v.shape or entry.k.shape[1] != entry.num_tokens:
        raise EntryError(f"entry shapes disagree: K {tuple(entry.k.shape)}, V {tuple(entry.v.shape)}, "
                         f"{entry.num_tokens} tokens")
    return entry


def _metadata(value: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (the format: an 8-byte little-endian length, then JSON)."""
    length = int.from_bytes(value[:8], "little")
    return json.loads(value[8:8 + length])["__metadata__"]
