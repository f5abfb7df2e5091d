"""KVCMAS: chained low-rank delta correction. The first agent prefills densely (exact cache); each
workflow edge i -> j corrects i's materialized cache of every shared segment with the
entropy-gated, token-weighted sum of low-rank corrections from an online anchor pool per slot;
a rejected match prefills the segment densely and becomes a new anchor."""

from __future__ import annotations

from kvbench.methods.delta.correction import DeltaCorrection
from kvbench.methods.specs.kvcmas import SPEC


class KVCMAS(DeltaCorrection, spec=SPEC):
    """The method `SPEC` declares, as its module docstring describes."""
