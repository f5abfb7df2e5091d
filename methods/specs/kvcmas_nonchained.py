"""KVCMAS without chaining (Fig. 6 ablation).
Its implementation: `kvbench.methods.kvcmas_nonchained`."""

from __future__ import annotations

from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.delta.params import NonChainedDeltaParams

SPEC = MethodSpec(
    name="kvcmas-nonchained",
    summary="KVCMAS corrected from a context-free reference (Fig. 6 ablation)",
    implementation="kvbench.methods.kvcmas_nonchained:KVCMASNonChained",
    Params=NonChainedDeltaParams,
    threshold_name="tau",
)
