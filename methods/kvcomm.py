"""KVComm: non-chained correction from a context-free reference, full-dimensional anchors (base
cache and per-agent corrections), V = 20, its gate (dense when entropy > gamma * log2(anchors),
the same test as normalized entropy > gamma) over the anchors covering the whole placeholder (two
at least, else dense: KVComm's `_select_anchor_indices` and `predict_as_anchor`), and layer 0
left uncorrected."""

from __future__ import annotations

from kvbench.methods.delta.correction import DeltaCorrection
from kvbench.methods.specs.kvcomm import SPEC


class KVComm(DeltaCorrection, spec=SPEC):
    chained = False
    low_rank = False
    correct_layer0 = False
    whole_coverage = True
