"""PReCache's PreLRShared. (Its implementation: `kvbench.methods.precache_prelr`.)"""

from __future__ import annotations

from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.precache.params import PReCacheParams

SPEC = MethodSpec(
    name="precache-prelr",
    summary=("PReCache PreLRShared: the writer's cache, values rebuilt per V-only adapter as V - writer's X A B + "
             "reader's X A B (LR entries from the writer's adapted pass)"),
    implementation="kvbench.methods.precache_prelr:PReCachePreLR",
    Params=PReCacheParams,
    needs_adapters=True,
)
