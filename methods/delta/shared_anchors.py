"""Anchor pools shared between instances (issue 68). Each instance's pools learn from the turns
routed to it; under `agent` routing that is half of them on two instances, and KVCMAS's realized
rho fell from 1.0 to 0.5 at 8K. Here every anchor an instance observes is published in the shared
tier (kvbench.methods.core.shared_state), with an index per slot of this writer's anchors and their
versions (an anchor gains corrections, one per consumer edge, as it is observed again), and a
reader brings its slot's pool up to date from every other writer's index before it decides a
segment: an anchor saved on one instance serves a turn on another.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from kvbench.methods.core.shared_state import SharedState
from kvbench.methods.delta.anchor_bytes import AnchorError, AnchorShape, anchor_from_bytes, anchor_to_bytes, shareable
from kvbench.methods.delta.anchors import AnchorPool

logger = logging.getLogger("kvbench.connector")


@dataclass
class AnchorExchange:
    """One worker's side of the shared pools: which anchors it observed (and publishes), and which
    version of each peer's anchors it has taken."""

    state: SharedState
    model: str
    expect: AnchorShape | None = None  # what an anchor of this worker's pools holds (state.shape's)
    own: dict[str, set[str]] = field(default_factory=dict)  # slot -> ids of anchors this worker observed
    published: dict[str, dict[str, int]] = field(default_factory=dict)  # slot -> anchor id -> version
    seen: dict[tuple[int, str, str], int] = field(default_factory=dict)  # (writer, slot, id) -> version taken

    @classmethod
    def over(cls, state: SharedState) -> AnchorExchange:
        """The exchange of a worker's pools through `state`, checking what it reads against its caches.
        Its writer number is claimed now, before any request: a reader that looked for writers
        before this one's first anchor would miss it while it trusts its list of writers
        (shared_state.PEERS_REFRESH_S)."""
        state.claim()
        shape = state.shape
        return cls(state, state.model, None if shape is None else AnchorShape(shape.layers, shape.kv_heads * shape.head_dim))

    def pull_safely(self, slot: str, pool: AnchorPool) -> None:
        """`pull` before a decision; a store that fails leaves the pool as it is (logged)."""
        if self.expect is None:
            return
        try:
            self.pull(slot, pool, self.expect, self.state.device)
        except Exception:
            logger.exception("kvbench: reading the other instances' anchors of %s failed", slot)

    def publish_safely(self, slot: str, pool: AnchorPool, observed: str) -> None:
        """`publish` after an observation; a store that fails keeps the anchor to this instance (logged)."""
        try:
            self.publish(slot, pool, observed)
        except Exception:
            logger.exception("kvbench: publishing anchor %s of %s failed", observed, slot)

    def publish(self, slot: str, pool: AnchorPool, observed: str) -> None:
        """After this worker observed anchor `observed` of `slot`: its anchors of the slot that are
        new or grew (a version is the corrections an anchor holds: it only gains them) published,
        those its pool evicted removed, and its index of the slot rewritten."""
        own = self.own.setdefault(slot, set())
        own.add(observed)
        own &= set(pool.anchors)  # an evicted anchor leaves this worker's index
        done = self.published.setdefault(slot, {})
        for anchor_id in sorted(own):
            anchor = pool.anchors[anchor_id]
            version = len(anchor.deltas)
            if done.get(anchor_id) != version and shareable(anchor):
                if self.state.publish(self._name(slot, anchor_id), anchor_to_bytes(anchor, slot, self.model)):
                    done[anchor_id] = version
        for gone in set(done) - own:
            del done[gone]
            self.state.remove(self._name(slot, gone))
        self.state.publish(self._index(slot), json.dumps(done, sort_keys=True).encode())

    def pull(self, slot: str, pool: AnchorPool, expect: AnchorShape, device: torch.device | str) -> int:
        """Every other writer's anchors of `slot` this worker has not taken at their current version,
        each checked (a foreign or corrupt one counted and left out): a new id joins the pool, a
        known one gains the corrections it lacks (another instance saw other edges of it). How
        many were taken."""
        taken = 0
        for writer in self.state.peers():
            raw = self.state.read(writer, self._index(slot))
            if raw is None:
                continue
            try:
                index = json.loads(raw)
                if not isinstance(index, dict) or not all(isinstance(v, int) for v in index.values()):
                    raise ValueError("not an object of versions")
            except ValueError:
                self.state.counts.rejected += 1
                continue
            for anchor_id, version in index.items():
                if self.seen.get((writer, slot, anchor_id), -1) >= version:
                    continue
                value = self.state.read(writer, self._name(slot, anchor_id))
                if value is None:
                    continue  # evicted since the index was written
                try:
                    anchor = anchor_from_bytes(value, self.model, slot, expect, device)
                    if anchor.anchor_id != anchor_id:
                        raise AnchorError(f"stored as {anchor_id!r}, holds {anchor.anchor_id!r}")
                    pool.merge(anchor)
                except (AnchorError, ValueError) as exc:
                    self.state.counts.rejected += 1
                    logger.warning("kvbench: anchor %s of slot %s from writer %d refused: %s", anchor_id, slot, writer, exc)
                    continue
                self.seen[(writer, slot, anchor_id)] = len(anchor.deltas)
                self.state.counts.imported += 1
                taken += 1
        return taken

    def forget(self) -> None:
        """After the method's state is reset: nothing held, nothing published (its keys removed)."""
        for slot, done in self.published.items():
            for anchor_id in done:
                self.state.remove(self._name(slot, anchor_id))
            self.state.publish(self._index(slot), b"{}")
        self.own.clear()
        self.published.clear()
        self.seen.clear()
        self.state.reset()

    @staticmethod
    def _index(slot: str) -> str:
        return f"{slot}/index"

    @staticmethod
    def _name(slot: str, anchor_id: str) -> str:
        return f"{slot}/anchor/{anchor_id}"
