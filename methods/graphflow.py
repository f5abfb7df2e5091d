"""GraphFlow: one correction per recurring relation (shared slot, target agent), calibrated from
the first dense observation against a context-free reference, then applied to new content
without online matching.

GraphFlow itself has no reuse-ratio knob, and the KVCMAS paper runs it at rho 0.79-0.83 without
saying how. kvbench gives it one, `rho`: a reuse budget spent in arrival order. Each segment is
corrected or prefilled densely, whichever leaves the reused share of the eligible shared tokens
seen so far nearer to rho (error diffusion). With no reliability signal (no matching), which
segments go dense cannot be chosen by quality, only counted; the realized rho of a trace lands
within half a segment's share of the target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.methods.delta.anchors import Correction
from kvbench.methods.delta.correction import DeltaCorrection, PendingAnchor, Rows
from kvbench.methods.delta.match_memo import SegmentDistances
from kvbench.methods.delta.stored import Stored, store
from kvbench.methods.specs.graphflow import SPEC


@dataclass
class Calibration:
    """A relation's correction: the dense target's K/V less the reference's (full-dimensional). No
    base cache: GraphFlow never compares against one."""

    delta_k: Stored
    delta_v: Stored
    uses: int = 0

    @property
    def length(self) -> int:
        return self.delta_v.length

    @property
    def nbytes(self) -> int:
        return self.delta_k.nbytes + self.delta_v.nbytes


@dataclass
class ReuseBudget:
    """Eligible and reused shared tokens so far."""

    eligible: int = 0
    reused: int = 0

    def allows(self, tokens: int, rho: float) -> bool:
        """Reusing `tokens` more leaves reused / eligible nearer to rho than computing them."""
        target = rho * (self.eligible + tokens)
        return self.reused + tokens - target <= target - self.reused + 1e-9 * tokens

    def count(self, tokens: int, reused: bool) -> None:
        self.eligible += tokens
        self.reused += tokens if reused else 0


class GraphFlow(DeltaCorrection, spec=SPEC):
    chained = False
    low_rank = False
    matching = False

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        self.calibrations: dict[tuple[str, str], Calibration] = {}  # by (slot, edge "ref->agent")
        self.budget = ReuseBudget()

    def _decide(self, slot: str, edge: str, n: int, rows: Callable[[], Rows],
                memo: SegmentDistances | None) -> dict[str, Any]:
        calibration = self.calibrations.get((slot, edge))
        if calibration is None:  # the first observation of this relation calibrates it
            self.budget.count(n, reused=False)
            return {"accept": False, "decision": "calibrate"}
        if not self.budget.allows(n, self.threshold()):
            self.budget.count(n, reused=False)
            return {"accept": False, "decision": "dense_budget", "observe": False}
        self.budget.count(n, reused=True)
        calibration.uses += 1
        covered = min(n, calibration.length)
        return {"accept": True, "decision": "accepted", "anchors": 1, "covered": covered,
                "correction": (Correction([calibration.delta_k], None, covered),
                               Correction([calibration.delta_v], None, covered))}

    def _observe(self, job: PendingAnchor, rank_base: int | None, rank_delta: int | None) -> None:
        key = (job.slot, job.edge)
        if key in self.calibrations:
            return  # calibrated already: GraphFlow keeps its first calibration
        source, target = self._observed_rows(job)
        self.calibrations[key] = Calibration(*(store(t - s, None, torch.bfloat16) for s, t in zip(source, target)))

    def _current_bytes(self) -> dict[str, int]:
        # What it applies and nothing else, under the key the delta methods' pools use.
        return {**super()._current_bytes(), "anchor_pool": sum(c.nbytes for c in self.calibrations.values())}

    def restart_peaks(self) -> None:
        # A measured run after priming warm-ups starts its budget afresh: otherwise it would
        # over-accept to make up for the warm-ups' calibrations (measured: rho 0.92 for 0.8).
        super().restart_peaks()
        self.budget = ReuseBudget()

    def reset(self) -> None:
        super().reset()
        self.calibrations.clear()
        self.budget = ReuseBudget()
