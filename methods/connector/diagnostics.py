"""Read-only views of the segment store for tests and analyses (worker RPCs)."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.methods.store import SegmentStore


def kv_error(store: SegmentStore, key: str, reference: str, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    """Normalized error ||C - C_ref||_F / ||C_ref||_F per layer over rows [start, stop)."""
    entry, ref = store.get(key), store.get(reference)
    if entry is None or ref is None:
        raise KeyError(f"not in the segment store: {key if entry is None else reference}")
    n = min(entry.num_tokens, ref.num_tokens, stop if stop is not None else 1 << 62)
    layers = []
    rows = slice(start, n)
    for layer in range(entry.k.shape[0]):
        row = {}
        for name, a, b in (("k", entry.k[layer, rows], ref.k[layer, rows]),
                           ("v", entry.v[layer, rows], ref.v[layer, rows])):
            expected = b.float()
            diff = a.float() - expected
            # this rank's share of the squared norms (tensor-parallel ranks' shards add up), and
            # the relative error they give
            sq_err, sq_ref = float(diff.square().sum()), float(expected.square().sum())
            row[f"{name}_sq_err"], row[f"{name}_sq_ref"] = sq_err, sq_ref
            row[f"{name}_rel"] = math.sqrt(sq_err) / max(math.sqrt(sq_ref), 1e-30)
            row[f"{name}_max_abs"] = float(diff.abs().max())
        layers.append(row)
    identical = bool(torch.equal(entry.k[:, rows], ref.k[:, rows]) and torch.equal(entry.v[:, rows], ref.v[:, rows]))
    return {"rows": n - start, "layers": layers, "bit_identical": identical,
            "same_tokens": bool(torch.equal(entry.token_ids[rows], ref.token_ids[rows]))}


def saved_rows(store: SegmentStore, key: str, layer: int, start: int, stop: int) -> dict[str, Any]:
    """K and V rows [start, stop) of one layer of a saved cache."""
    entry = store.get(key)
    if entry is None:
        raise KeyError(f"not in the segment store: {key}")
    return {"k": entry.k[layer, start:stop].float().tolist(), "v": entry.v[layer, start:stop].float().tolist()}
