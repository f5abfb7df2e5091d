"""PReCache's parameters, which both variants share (torch-free: their specs import them)."""

from __future__ import annotations

from pydantic import Field

from kvbench.methods.api.params import MethodParams


class PReCacheParams(MethodParams):
    max_state_gib: float = Field(1.0, gt=0, description="LR caches (and ReBase's base caches) kept, LRU beyond it")
    eager_build: bool = Field(True, description="build a saved source's LR entries as deferred work right after its "
                                                "save (False: only at the first load that reads it, inside its TTFT)")
