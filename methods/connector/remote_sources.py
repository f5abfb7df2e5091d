"""The scheduler side's view of the shared tier: whether the sources a turn reads that ran on another
instance are in Mooncake Store yet. Such a source's response reached the replayer before this turn
was sent, but its instance saves it in a later engine step; the turn is held back (claim None) until
the store has it, for at most REMOTE_GRACE_S, and then goes ahead: its load misses and computes the
rows, so a cache that never comes costs a bounded wait, never a hang."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Container

from kvbench.contracts import Plan
from kvbench.methods.core.mooncake_tier import MooncakeTier, SharedTierSettings, shared_key

logger = logging.getLogger("kvbench.connector")

REMOTE_GRACE_S = 10.0
MAX_FOUND_KEYS = 100_000


def plan_sources(plan: Plan) -> dict[str, str | None]:
    """Every cache the request reads -> the adapter that wrote it (its shared key's part)."""
    sources: dict[str, str | None] = {key: plan.adapter for key in plan.prefix_sources}
    sources.update({s.source: s.source_adapter for s in plan.segments if s.source})
    return sources


class RemoteSources:
    def __init__(self, tier: MooncakeTier, model: str, ranks: int) -> None:
        self.tier, self.model, self.ranks = tier, model, ranks
        self._found: OrderedDict[str, None] = OrderedDict()  # save keys seen in the store
        self._waiting_since: dict[str, float] = {}

    @classmethod
    def connect(cls, settings: SharedTierSettings, model: str, ranks: int) -> RemoteSources:
        return cls(MooncakeTier(settings, lend_memory=False), model, ranks)

    def holds_back(self, req_id: str, plan: Plan, local_keys: Container[str]) -> bool:
        """Whether request `req_id` waits for a source that ran elsewhere (`local_keys`: the save
        keys of requests this instance ran) and is not in the shared tier yet."""
        wanted = {shared_key(self.model, key, adapter, 0, self.ranks): key for key, adapter in plan_sources(plan).items()
                  if key not in local_keys and key not in self._found}
        if wanted:
            try:
                present = self.tier.exists(list(wanted))
            except Exception:  # the store unreachable: the load will miss and compute
                logger.exception("kvbench: asking the shared tier for %s failed", sorted(wanted.values()))
                present = dict.fromkeys(wanted, True)
            for shared, here in present.items():
                if here:
                    self._found[wanted[shared]] = None
            while len(self._found) > MAX_FOUND_KEYS:
                self._found.popitem(last=False)
            if not all(present.values()):
                since = self._waiting_since.setdefault(req_id, time.perf_counter())
                if time.perf_counter() - since < REMOTE_GRACE_S:
                    return True
                logger.warning("kvbench: %s waited %.0f s for sources from another instance; it computes them",
                               req_id, REMOTE_GRACE_S)
        self._waiting_since.pop(req_id, None)
        return False

    def forget(self, req_id: str) -> None:
        self._waiting_since.pop(req_id, None)
