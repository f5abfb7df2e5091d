"""The segment store over a shared tier (issue 53): a save is kept locally as before and put in
Mooncake Store under its shared key; a lookup tries the local store, then the shared tier (a
remote hit is kept locally, so the next reader of it on this instance hits there), and a miss is
what it always was: the rows are computed densely. A remote value this reader may not place (corrupt,
another model or codec) is counted, never placed."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvbench.methods.core.entry_bytes import EntryError, EntryShape, entry_from_bytes, entry_to_bytes
from kvbench.methods.core.kv_codec import KVCodec
from kvbench.methods.core.mooncake_tier import MooncakeTier, SharedTierSettings, shared_key
from kvbench.methods.core.shared_state import SharedState
from kvbench.methods.core.store import CompressedKV, SavedKV, SegmentStore

logger = logging.getLogger("kvbench.connector")

# Counts that travel on vLLM's connector-stats path (kvbench.methods.connector.counters), as deltas
COUNTED = ("local_hits", "remote_hits", "misses", "rejected", "remote_bytes", "puts", "put_bytes", "put_failures")


class TieredStore(SegmentStore):
    def __init__(self, max_bytes: int, codec: KVCodec | None, tier: MooncakeTier, model: str) -> None:
        super().__init__(max_bytes, codec)
        self.tier, self.model = tier, model
        self.device: torch.device | str = "cpu"  # where fetched entries go: the paged caches' device
        self.rank, self.ranks = 0, 1  # this worker's tensor-parallel rank: its entries hold its heads
        self.shape: EntryShape | None = None  # what this model's entries hold: a fetched one is checked against it
        self._reported: dict[str, int] = {}
        self.states: dict[str, SharedState] = {}  # method state shared beside the entries, by namespace

    def placed_on(self, device: torch.device | str, rank: int, ranks: int, shape: Any = None) -> None:
        self.device, self.rank, self.ranks, self.shape = device, rank, ranks, shape

    def key(self, key: str, adapter: str | None) -> str:
        return shared_key(self.model, key, adapter, self.rank, self.ranks)

    def put(self, key: str, entry: SavedKV, adapter: str | None = None) -> float:
        seconds = super().put(key, entry)
        held = self.entries.get(key)
        if held is not None:  # (one larger than the local cap is not shared either)
            try:
                self.tier.put(self.key(key, adapter), entry_to_bytes(held, self.model))
            except Exception:  # the local copy serves this instance; others compute
                logger.exception("kvbench: putting %s in the shared tier failed", key)
                self.tier.counts.put_failures += 1
        return seconds

    def get(self, key: str, adapter: str | None = None) -> SavedKV | None:
        if key in self.entries:
            self.tier.counts.local_hits += 1
            return super().get(key)
        fetched = self._fetch(key, adapter)
        if fetched is None:
            return None
        self._put(key, fetched)
        held = super().get(key)
        if held is not None:
            return held
        return fetched.decompress() if isinstance(fetched, CompressedKV) else fetched  # larger than the local cap

    def exact_entry(self, key: str, adapter: str | None = None) -> SavedKV | None:
        if key in self.entries:
            self.tier.counts.local_hits += 1
        elif (fetched := self._fetch(key, adapter)) is not None:
            self._put(key, fetched)
        return super().exact_entry(key)

    def _fetch(self, key: str, adapter: str | None) -> SavedKV | CompressedKV | None:
        started = time.perf_counter()
        try:
            return self._fetch_entry(key, adapter)
        finally:
            self.fetch_s += time.perf_counter() - started

    def _fetch_entry(self, key: str, adapter: str | None) -> SavedKV | CompressedKV | None:
        counts = self.tier.counts
        try:
            value = self.tier.get(self.key(key, adapter))
        except Exception:
            logger.exception("kvbench: reading %s from the shared tier failed", key)
            value = None
        if value is None:
            counts.misses += 1
            return None
        try:
            entry = entry_from_bytes(value, self.model, self.codec, self.device, self.shape)
        except EntryError as exc:
            logger.warning("kvbench: shared-tier entry %s refused, computed densely: %s", key, exc)
            counts.rejected += 1
            counts.misses += 1
            return None
        counts.remote_hits += 1
        self.fetched += 1
        self.fetched_bytes += len(value)
        return entry

    def clear(self) -> None:
        super().clear()
        self.tier.clear()
        self._reported = {}

    def take_counts(self) -> dict[str, int]:
        """The counted figures' growth since the last take (for /metrics), keyed `shared_<name>`."""
        now = {name: int(getattr(self.tier.counts, name)) for name in COUNTED}
        grown = {f"shared_{name}": value - self._reported.get(name, 0) for name, value in now.items()
                 if value > self._reported.get(name, 0)}
        self._reported = now
        return grown

    def report(self) -> dict[str, Any]:
        """What the tier did since the last reset: {"shared_tier": counts} (WorkerStats.extra)."""
        return {"shared_tier": {**self.tier.counts.to_dict(), "segment_bytes": self.tier.settings.segment_bytes}}

    def shared_state(self, namespace: str) -> SharedState | None:
        """Method state shared beside this store's entries, one per namespace for the worker's life
        (its writer number claimed once); None with several tensor-parallel ranks (their decisions
        must agree, and one rank could see a peer's value before another does)."""
        if self.ranks > 1 or self.shape is None:
            logger.warning("kvbench: %s stays on this instance (%d tensor-parallel ranks)", namespace, self.ranks)
            return None
        if namespace not in self.states:
            self.states[namespace] = SharedState(self.tier, self.model, namespace, shape=self.shape, device=self.device)
        return self.states[namespace]


def segment_store(max_bytes: int, codec: KVCodec | None, shared: SharedTierSettings | None, model: str) -> SegmentStore:
    """A worker's store: local only, or over the shared tier `shared` names."""
    return SegmentStore(max_bytes, codec) if shared is None else TieredStore(max_bytes, codec, MooncakeTier(shared), model)
