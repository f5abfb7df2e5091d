"""GraphFlow: one correction per recurring relation (shared slot, target agent), calibrated from
the first dense observation against a context-free reference, then applied to new content
without online matching."""

from __future__ import annotations

from typing import Any, ClassVar

from kvbench.methods.delta import DeltaCorrection


class GraphFlow(DeltaCorrection):
    name = "graphflow"
    chained = False
    low_rank = False
    matching = False
    defaults: ClassVar[dict[str, Any]] = {}
