"""The work items of delta correction: observations waiting to become anchors, corrections
being applied, dense fallbacks, prematches, and lazily built source rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from kvbench.contracts import PlanSegment
from kvbench.methods.base import SegmentReuse
from kvbench.methods.delta.anchors import Correction

Rows = tuple[torch.Tensor, torch.Tensor]  # keys (canonical positions), values: [layers, n, D]


@dataclass
class PendingAnchor:
    """A dense fallback's observation, turned into an anchor after the request's first token."""

    req_id: str  # the request whose load observed it: built once that request is computed
    slot: str
    anchor_id: str
    edge: str
    source: SegmentReuse  # the rows the correction would have been applied to
    target_k: torch.Tensor  # the dense rows as computed [layers, n, H, hd], keys at the target positions
    target_v: torch.Tensor


@dataclass
class AcceptedCorrection:
    """What an accepted segment's reused rows get, layer by layer, in `correct`."""

    k: Correction
    v: Correction
    segment_start: int  # corrections live in canonical positions: keys are turned to this start
    segment_id: str
    apply_s: float = 0.0  # time spent applying them, over the layers


@dataclass
class Fallback:
    segment: PlanSegment
    reuse: SegmentReuse
    edge: str


@dataclass
class Prematch:
    """A segment of a request that will be saved: matched against its slot's anchors after the
    request's first token, when its rows are final, for the edges that will read it."""

    req_id: str  # the saved request: matched once it is computed
    key: Hashable  # (save key, start in that cache, slot): what a consumer's segment names
    slot: str
    start: int
    read: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # its rows [layers, n, H, hd] from the paged cache


class LazyRows:
    """A decision's source rows, computed on first use only (memoized distances may spare them)."""

    def __init__(self, compute: Callable[[], Rows]) -> None:
        self._compute, self._rows, self.seconds = compute, None, 0.0

    def __call__(self) -> Rows:
        if self._rows is None:
            started = time.perf_counter()
            self._rows = self._compute()
            self.seconds = time.perf_counter() - started
        return self._rows
