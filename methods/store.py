"""Finished requests' K/V kept in worker memory, byte-capped, least recently used evicted first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class SavedKV:
    """One finished request's cache (this rank's KV heads): prompt and generated tokens."""

    token_ids: torch.Tensor  # [n] int64
    k: torch.Tensor  # [L, n, Hkv, hd], keys rotated at positions 0..n-1
    v: torch.Tensor  # [L, n, Hkv, hd]
    # The residual stream entering one layer (DroidSpeak's E-cache), kept only for methods that
    # recompute layers from it: `hidden` [n, hidden size] at layer `hidden_layer`, valid where
    # `hidden_valid` [n] is set (rows the partial forward computed or carried; not the rows vLLM
    # computed itself, such as generated tokens).
    hidden: torch.Tensor | None = None
    hidden_valid: torch.Tensor | None = None
    hidden_layer: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        hidden = 0 if self.hidden is None else self.hidden.nbytes + self.hidden_valid.nbytes  # type: ignore[union-attr]
        return self.k.nbytes + self.v.nbytes + self.token_ids.nbytes + hidden


class SegmentStore:
    """Byte-capped LRU. `peak_bytes`, `evictions` and `refused` count since the last `clear()`
    (one run), so a run on a reused server reports its own figures, not an earlier run's."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, SavedKV] = OrderedDict()
        self.bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self.refused = 0  # entries larger than the whole budget, never stored

    def put(self, key: str, entry: SavedKV) -> None:
        if entry.nbytes > self.max_bytes:
            self.refused += 1
            return  # larger than the whole budget: keep nothing rather than evict everything
        if key in self.entries:
            self.bytes -= self.entries.pop(key).nbytes
        self.entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def get(self, key: str) -> SavedKV | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self.refused = 0
