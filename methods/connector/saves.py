"""Copying a finished request's cache from vLLM's paged blocks into the segment store."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench.methods.connector.specs import SaveSpec
from kvbench.methods.core.store import SavedKV

# (layer name, block ids, rows) -> K, V [rows, Hkv, hd] of one layer, read from the paged cache
ReadLayer = Callable[[str, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
# rows vLLM's partial forward computed, their residual stream [rows, hidden], the layer it enters
Hidden = tuple[torch.Tensor, torch.Tensor, int]


def saved_copy(save: SaveSpec, layer_names: list[str], read_layer: ReadLayer, hidden: Hidden | None,
               exact_rows: int | None = None) -> SavedKV:
    """The request's K/V as one [layers, n, Hkv, hd] tensor each, with the residual stream the
    load captured for the rows it computed (rows vLLM computed, its generated tokens, have none).
    `exact_rows`: its first rows a dense prefill would have computed alike (None: all of them)."""
    n = len(save.token_ids)
    block_ids = torch.tensor(save.block_ids, dtype=torch.long)
    keys = values = None
    for index, name in enumerate(layer_names):
        k, v = read_layer(name, block_ids, n)
        if keys is None or values is None:
            keys = k.new_empty((len(layer_names), *k.shape))
            values = v.new_empty((len(layer_names), *v.shape))
        keys[index].copy_(k)
        values[index].copy_(v)
    if keys is None or values is None:
        raise RuntimeError("no KV cache layers to save from")
    entry = SavedKV(torch.tensor(save.token_ids, dtype=torch.long), keys, values,
                    exact_rows=n if exact_rows is None else min(n, exact_rows))
    if hidden is not None:
        rows, stream, layer = hidden
        entry.hidden = stream.new_zeros((n, stream.shape[1]))
        entry.hidden_valid = torch.zeros(n, dtype=torch.bool)
        entry.hidden[rows.to(stream.device)], entry.hidden_valid[rows] = stream, True
        entry.hidden_layer = layer
    return entry
