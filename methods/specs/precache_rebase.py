"""PReCache's ReBaseShared. (Its implementation: `kvbench.methods.precache_rebase`.)"""

from __future__ import annotations

from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.precache.params import PReCacheParams

SPEC = MethodSpec(
    name="precache-rebase",
    summary=("PReCache ReBaseShared: an adapter-free pass's keys and base values, plus the reader's V-only "
             "adapter term X A B (built after the source's save)"),
    implementation="kvbench.methods.precache_rebase:PReCacheReBase",
    Params=PReCacheParams,
    needs_adapters=True,
)
