"""PReCache's ReBaseShared: keys, base values and every adapter's LR entries from an adapter-free
pass over the source; a reader's values are the base plus its adapter's term
(kvbench.methods.precache). With a zero adapter (B = 0) the reused rows are the base model's."""

from __future__ import annotations

from kvbench.methods.precache import PReCache
from kvbench.methods.registry import register_method


@register_method
class PReCacheReBase(PReCache):
    name = "precache-rebase"
    summary = ("PReCache ReBaseShared: an adapter-free pass's keys and base values, plus the reader's V-only "
               "adapter term X A B (built after the source's save)")
    adapter_free_base = True
