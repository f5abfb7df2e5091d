"""PReCache's PreLRShared: the writer's adapted pass gives the shared cache and every adapter's LR
entries; a reader's values are the writer's minus its adapter's term plus the reader's
(kvbench.methods.precache)."""

from __future__ import annotations

from kvbench.methods.precache import PReCache
from kvbench.methods.registry import register_method


@register_method
class PReCachePreLR(PReCache):
    name = "precache-prelr"
    summary = ("PReCache PreLRShared: the writer's cache, values rebuilt per V-only adapter as V - writer's X A B + "
               "reader's X A B (LR entries from the writer's adapted pass)")
    adapter_free_base = False
