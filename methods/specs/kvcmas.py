"""KVCMAS: chained low-rank delta correction from an online anchor pool.
Its implementation: `kvbench.methods.kvcmas`."""

from __future__ import annotations

from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.delta.params import DeltaParams

SPEC = MethodSpec(
    name="kvcmas",
    summary="chained low-rank delta correction from an online anchor pool (V=10, r=32, tau=0.3)",
    implementation="kvbench.methods.kvcmas:KVCMAS",
    Params=DeltaParams,
    threshold_name="tau",
)
