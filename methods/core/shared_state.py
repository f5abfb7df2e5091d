"""A method's online state shared between instances through the shared tier (issue 68): KVCMAS's
and KVComm's anchor pools, which each instance would otherwise learn from its share of the turns
alone. Mooncake Store has no listing, so each writer (one tensor-parallel rank of one instance)
claims a number once, `writers/<n>`, with a put that never overwrites (the first claim of a number
holds it), and keeps its values under its own keys; a reader finds the writers by asking for
numbers until one is missing. A writer replaces only its own values (upsert): no two writers ever
race on a key. What is read back is bytes: its reader checks them (kvbench.methods.delta.anchor_bytes).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvbench.methods.core.entry_bytes import EntryShape
from kvbench.methods.core.mooncake_tier import MooncakeTier, model_tag

logger = logging.getLogger("kvbench.connector")

PEERS_REFRESH_S = 1.0  # how long a reader trusts its list of writers before asking again
MAX_WRITERS = 256  # numbers a reader asks about at most (instances x ranks of one deployment)


@dataclass
class SharedStateCounts:
    """What a worker's shared state did since its last reset (WorkerStats.extra["shared_state"])."""

    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    remote_reads: int = 0  # values found under a peer's key
    remote_bytes: int = 0
    rejected: int = 0  # values read that their reader refused (corrupt, another model, other shapes)
    imported: int = 0  # values their reader took (an anchor added to its pool)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SharedState:
    """One worker's view of a method state shared under `namespace` (e.g. "anchors") between every
    instance that serves `model` on the same Mooncake master, rank by rank."""

    def __init__(self, tier: MooncakeTier, model: str, namespace: str, rank: int = 0, ranks: int = 1,
                 shape: EntryShape | None = None, device: torch.device | str = "cpu") -> None:
        self.tier, self.model = tier, model
        self.shape, self.device = shape, device  # this worker's caches: what a value read must fit, and where it goes
        self.prefix = f"kvbench/{model_tag(model)}/state/{namespace}/tp{rank}of{ranks}"
        self.counts = SharedStateCounts()
        self.writer: int | None = None
        self._token = secrets.token_hex(8).encode()  # what this writer's claim holds
        self._peers: list[int] = []
        self._peers_at = -PEERS_REFRESH_S

    def _writer_key(self, number: int) -> str:
        return f"{self.prefix}/writers/{number}"

    def claim(self) -> int | None:
        """This worker's writer number (claimed on first use); None when every number is taken or
        the store cannot be reached (its state then stays its own)."""
        if self.writer is not None:
            return self.writer
        for number in range(MAX_WRITERS):
            key = self._writer_key(number)
            try:
                self.tier.store.put(key, self._token)  # never replaces: an earlier claim stays
                if self.tier.store.get(key) == self._token:
                    self.writer = number
                    return number
            except Exception:
                logger.exception("kvbench: claiming a shared-state writer number failed")
                return None
        logger.warning("kvbench: %s has %d writers already; this one keeps its state to itself", self.prefix,
                       MAX_WRITERS)
        return None

    def peers(self) -> list[int]:
        """The other writers' numbers (asked again at most every PEERS_REFRESH_S)."""
        now = time.monotonic()
        if now - self._peers_at >= PEERS_REFRESH_S:
            found: list[int] = []
            for start in range(0, MAX_WRITERS, 16):
                keys = [self._writer_key(n) for n in range(start, start + 16)]
                present = self.tier.exists(keys)
                numbers = [start + i for i, key in enumerate(keys) if present[key]]
                found += numbers
                if len(numbers) < len(keys):  # numbers are claimed in order: the first gap ends them
                    break
            self._peers, self._peers_at = [n for n in found if n != self.writer], now
        return list(self._peers)

    def _key(self, writer: int, name: str) -> str:
        return f"{self.prefix}/w{writer}/{name}"

    def publish(self, name: str, value: bytes) -> bool:
        """`value` under this writer's `name`, replacing its earlier one; False if not stored."""
        writer = self.claim()
        if writer is None:
            return False
        try:
            code = self.tier.store.upsert(self._key(writer, name), value)
        except Exception:
            logger.exception("kvbench: publishing %s failed", name)
            code = -1
        if code != 0:
            self.counts.put_failures += 1
            return False
        self.counts.puts += 1
        self.counts.put_bytes += len(value)
        return True

    def remove(self, name: str) -> None:
        """This writer's value under `name` gone (an evicted anchor)."""
        if self.writer is not None:
            try:
                self.tier.store.remove(self._key(self.writer, name))
            except Exception:
                logger.exception("kvbench: removing %s failed", name)

    def read(self, writer: int, name: str) -> bytes | None:
        """Writer `writer`'s value under `name` (None: it has none, or the store failed)."""
        try:
            value = self.tier.store.get(self._key(writer, name))
        except Exception:
            logger.exception("kvbench: reading %s of writer %d failed", name, writer)
            return None
        if not value:
            return None
        self.counts.remote_reads += 1
        self.counts.remote_bytes += len(value)
        return bytes(value)

    def report(self) -> dict[str, Any]:
        return {**self.counts.to_dict(), "writer": self.writer}

    def reset(self) -> None:
        """Zero the counts (the claim stays: it names this worker for the server's life)."""
        self.counts = SharedStateCounts()
