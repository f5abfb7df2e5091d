"""KVCMAS without chaining (the paper's Fig. 6 ablation): every agent, the first included, is
corrected from a context-free reference of each segment, prefilled on first sight."""

from __future__ import annotations

from kvbench.methods.delta.correction import DeltaCorrection
from kvbench.methods.specs.kvcmas_nonchained import SPEC


class KVCMASNonChained(DeltaCorrection, spec=SPEC):
    chained = False
