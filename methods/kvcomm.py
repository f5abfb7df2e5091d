"""KVComm: non-chained correction from a context-free reference, full-dimensional anchors (base
cache and per-agent corrections), V = 20, its gate (dense when entropy > gamma * log2(anchors),
the same test as normalized entropy > gamma), and layer 0 left uncorrected."""

from __future__ import annotations

from typing import Any, ClassVar

from kvbench.methods.delta import DeltaCorrection


class KVComm(DeltaCorrection):
    name = "kvcomm"
    chained = False
    low_rank = False
    correct_layer0 = False
    threshold_name = "gamma"
    defaults: ClassVar[dict[str, Any]] = {"V": 20, "gamma": 0.3, "gate_tokens": 0}
