"""GraphFlow: one calibrated correction per relation, a reuse budget instead of matching.
Its implementation: `kvbench.methods.graphflow`."""

from __future__ import annotations

from pydantic import Field

from kvbench.methods.api.params import MethodParams
from kvbench.methods.api.spec import MethodSpec


class GraphFlowParams(MethodParams):
    rho: float = Field(0.8, ge=0, le=1, description="target reuse ratio: each segment is corrected or prefilled "
                       "densely, whichever keeps the reused share of eligible shared tokens nearer to it")


SPEC = MethodSpec(
    name="graphflow",
    summary="one calibrated correction per (slot, target agent), no online matching; rho: reuse budget",
    implementation="kvbench.methods.graphflow:GraphFlow",
    Params=GraphFlowParams,
    threshold_name="rho",
)
