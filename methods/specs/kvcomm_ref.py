"""KVComm as its public code runs it. (Its implementation: `kvbench.methods.kvcomm_ref`.)"""

from __future__ import annotations

from kvbench.methods.api.spec import MethodSpec
from kvbench.methods.specs.kvcomm import KVCommParams

SPEC = MethodSpec(
    name="kvcomm-ref",
    summary="KVComm as its code runs: BOS-prefixed references, outputs from the producer's cache, per-agent fallback",
    implementation="kvbench.methods.kvcomm_ref:KVCommRef",
    Params=KVCommParams,
    threshold_name="gamma",
)
