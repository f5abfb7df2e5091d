"""PReCache's PreLRShared: the writer's adapted pass gives the shared cache and every adapter's LR
entries; a reader's values are the writer's minus its adapter's term plus the reader's
(kvbench.methods.precache.base)."""

from __future__ import annotations

from kvbench.methods.precache.base import PReCache
from kvbench.methods.specs.precache_prelr import SPEC


class PReCachePreLR(PReCache, spec=SPEC):
    adapter_free_base = False
