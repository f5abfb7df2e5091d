"""FullShared: the source agent's cache reused as is, re-aligned (the upper bound on speed).
Its implementation: `kvbench.methods.fullshared`."""

from __future__ import annotations

from kvbench.methods.api.spec import MethodSpec

SPEC = MethodSpec(
    name="fullshared",
    summary="reuse the source agent's K/V of every shared segment, re-aligned, no correction",
    implementation="kvbench.methods.fullshared:FullShared",
)
