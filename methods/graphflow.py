"""GraphFlow: one correction per recurring relation (shared slot, target agent), calibrated from
the first dense observation against a context-free reference, then applied to new content
without online matching."""

from __future__ import annotations

from kvbench.methods.base import MethodParams
from kvbench.methods.delta import DeltaCorrection
from kvbench.methods.registry import register_method


@register_method
class GraphFlow(DeltaCorrection):
    name = "graphflow"
    summary = "one calibrated correction per (slot, target agent), no online matching"
    Params = MethodParams
    chained = False
    low_rank = False
    matching = False
