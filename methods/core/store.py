"""Finished requests' K/V kept in worker memory, byte-capped, least recently used evicted first."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.methods.core.kv_codec import Encoded, KVCodec


class _HeldRows:
    """Sizes of a stored cache (K and V as kept: tensors, or a codec's encoding of them)."""

    token_ids: torch.Tensor
    k: torch.Tensor | Encoded
    v: torch.Tensor | Encoded
    hidden: torch.Tensor | None
    hidden_valid: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        hidden = 0 if self.hidden is None else self.hidden.nbytes + self.hidden_valid.nbytes  # type: ignore[union-attr]
        return self.k.nbytes + self.v.nbytes + self.token_ids.nbytes + hidden


@dataclass
class SavedKV(_HeldRows):
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
    # Its first rows hold what a dense prefill of its tokens computes (no reused row before them):
    # a later request with the same tokens there may copy them as vLLM's prefix cache would
    # serve them. 0: none known exact (a compressed entry's decoded rows never are).
    exact_rows: int = 0


@dataclass
class CompressedKV(_HeldRows):
    """A SavedKV as a codec keeps it: K and V encoded, the rest as is. `get` hands readers a
    decompressed SavedKV (PolyKV's agents read the pool by decompressing it into their cache)."""

    token_ids: torch.Tensor
    k: Encoded
    v: Encoded
    codec: KVCodec
    hidden: torch.Tensor | None = None
    hidden_valid: torch.Tensor | None = None
    hidden_layer: int | None = None

    @classmethod
    def compress(cls, entry: SavedKV, codec: KVCodec) -> CompressedKV:
        return cls(entry.token_ids, codec.encode_keys(entry.k), codec.encode_values(entry.v), codec, entry.hidden,
                   entry.hidden_valid, entry.hidden_layer)

    def decompress(self) -> SavedKV:
        return SavedKV(self.token_ids, self.codec.decode_keys(self.k), self.codec.decode_values(self.v), self.hidden,
                       self.hidden_valid, self.hidden_layer)


class SegmentStore:
    """Byte-capped LRU. `peak_bytes`, `evictions` and `refused` count since the last `clear()`
    (one run), so a run on a reused server reports its own figures, not an earlier run's."""

    def __init__(self, max_bytes: int, codec: KVCodec | None = None) -> None:
        self.max_bytes = max_bytes
        # None: entries kept as saved; a codec: compressed on put, decompressed on get
        self.codec = codec
        self.entries: OrderedDict[str, SavedKV | CompressedKV] = OrderedDict()
        self.decode_s = 0.0  # time spent decompressing entries for readers, since the last clear()
        self.decoded_tokens = 0
        # entries read from a shared tier (kvbench.methods.core.tiered_store): count, bytes, seconds
        # (get and parse), since the last clear(); a local store reads none
        self.fetched, self.fetched_bytes, self.fetch_s = 0, 0, 0.0
        self._last_decoded: tuple[str, SavedKV] | None = None  # a load reads several segments of one source
        self.bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self.refused = 0  # entries larger than the whole budget, never stored
        self.refused_keys: set[str] = set()  # their keys: a reader missing one was refused, not evicted

    def put(self, key: str, entry: SavedKV, adapter: str | None = None) -> float:
        """Keep `entry` (compressed when the store has a codec); returns the seconds compressing took.
        `adapter`: the LoRA adapter that wrote it (a shared tier keys entries by it)."""
        started = time.perf_counter()
        stored: SavedKV | CompressedKV = entry if self.codec is None else CompressedKV.compress(entry, self.codec)
        seconds = time.perf_counter() - started if self.codec is not None else 0.0
        self._put(key, stored)
        return seconds

    def _put(self, key: str, entry: SavedKV | CompressedKV) -> None:
        if self._last_decoded is not None and self._last_decoded[0] == key:
            self._last_decoded = None
        if entry.nbytes > self.max_bytes:
            self.refused += 1
            self.refused_keys.add(key)
            return  # larger than the whole budget: keep nothing rather than evict everything
        self.refused_keys.discard(key)
        if key in self.entries:
            self.bytes -= self.entries.pop(key).nbytes
        self.entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def get(self, key: str, adapter: str | None = None) -> SavedKV | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        if isinstance(entry, CompressedKV):
            if self._last_decoded is not None and self._last_decoded[0] == key:
                return self._last_decoded[1]
            started = time.perf_counter()
            decoded = entry.decompress()
            self.decode_s += time.perf_counter() - started
            self.decoded_tokens += entry.num_tokens
            self._last_decoded = (key, decoded)
            return decoded
        return entry

    def exact_entry(self, key: str, adapter: str | None = None) -> SavedKV | None:
        """The entry under `key` if it is kept as saved with exact rows (SavedKV.exact_rows > 0), else
        None; a peek: nothing decoded (a compressed entry's rows are never exact), LRU order kept."""
        entry = self.entries.get(key)
        return entry if isinstance(entry, SavedKV) and entry.exact_rows > 0 else None

    def was_refused(self, key: str) -> bool:
        """The entry under `key` was larger than the whole cap, so never stored (not evicted)."""
        return key in self.refused_keys

    def stored_nbytes(self, key: str) -> int | None:
        """The bytes an entry holds as stored (compressed or not)."""
        entry = self.entries.get(key)
        return None if entry is None else entry.nbytes

    # A shared tier under the store (kvbench.methods.core.tiered_store) answers these; a local one has none.
    def placed_on(self, device: torch.device | str, rank: int, ranks: int, shape: Any = None) -> None:
        """Where its entries live: the paged caches' device, this worker's tensor-parallel rank, and
        what an entry of this model holds (entry_bytes.EntryShape: what a shared store checks)."""

    def take_counts(self) -> dict[str, int]:
        return {}

    def report(self) -> dict[str, Any]:
        """What a shared tier under the store did (WorkerStats.extra); {} without one."""
        return {}

    def shared_state(self, namespace: str) -> Any:
        """Method state shared with other instances (kvbench.methods.core.shared_state); None without a shared tier."""
        return None

    def clear(self) -> None:
        self.entries.clear()
        self._last_decoded = None
        self.decoded_tokens = 0
        self.decode_s = 0.0
        self.fetched, self.fetched_bytes, self.fetch_s = 0, 0, 0.0
        self.bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self.refused = 0
        self.refused_keys.clear()
