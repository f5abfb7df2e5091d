"""PReCache's ReBaseShared: keys, base values and every adapter's LR entries from an adapter-free
pass over the source; a reader's values are the base plus its adapter's term
(kvbench.methods.precache.base). With a zero adapter (B = 0) the reused rows are the base model's."""

from __future__ import annotations

from kvbench.methods.precache.base import PReCache
from kvbench.methods.specs.precache_rebase import SPEC


class PReCacheReBase(PReCache, spec=SPEC):
    adapter_free_base = True
