"""The work items of delta correction: observations waiting to become anchors, corrections
being applied, dense fallbacks, prematches, and lazily built source rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from kvbench.contracts import PlanSegment
from kvbench.methods.api.base import SegmentReuse
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
    # the dense rows as computed [layers, n, H, hd], keys at the target positions (None: they never came)
    target: Callable[[], tuple[torch.Tensor, torch.Tensor] | None]
    target_k: torch.Tensor | None = None  # the target's rows, once read
    target_v: torch.Tensor | None = None


@dataclass
class AcceptedCorrection:
    """What an accepted segment's reused rows get, layer by layer, in `correct`."""

    k: Correction
    v: Correction
    segment_start: int  # corrections live in canonical positions: keys are turned to this start
    segment_id: str
    reuse: SegmentReuse  # the rows it applies to (kept: its id is the correction's key)
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
    read: Callable[[], tuple[torch.Tensor, torch.Tensor] | None]  # its rows [layers, n, H, hd] as computed


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


MAX_OPEN_DECISIONS = 256  # requests decided whose load has not ended yet, kept at most


class OpenDecisions:
    """What each request's decision leaves for its load, by request key: the accepted corrections
    (found again by their reuse: `correct` sees only the rows) and the dense fallbacks to observe.
    Decisions made ahead of their loads (SharingMethod.decides_before_claim) may overlap."""

    def __init__(self) -> None:
        self._corrections: dict[int, AcceptedCorrection] = {}  # by id(reuse); each holds its reuse
        self._accepted: dict[str, list[int]] = {}
        self._fallbacks: dict[str, list[Fallback]] = {}

    def open(self, request_key: str) -> list[Fallback]:
        """A request's decision starts (again): its fallbacks list, to fill."""
        self.close(request_key)
        while len(self._fallbacks) >= MAX_OPEN_DECISIONS:  # decisions whose load never came (aborted)
            self.close(next(iter(self._fallbacks)))
        self._accepted[request_key] = []
        fallbacks = self._fallbacks[request_key] = []
        return fallbacks

    def accept(self, request_key: str, correction: AcceptedCorrection) -> None:
        self._corrections[id(correction.reuse)] = correction
        self._accepted.setdefault(request_key, []).append(id(correction.reuse))

    def withdraw(self, reuse: SegmentReuse) -> None:
        self._corrections.pop(id(reuse), None)

    def correction(self, reuse: SegmentReuse) -> AcceptedCorrection | None:
        entry = self._corrections.get(id(reuse))
        return entry if entry is not None and entry.reuse is reuse else None

    def close(self, request_key: str) -> tuple[list[AcceptedCorrection], list[Fallback]]:
        """The request's load ended (or never comes): what it applied and what it sent dense."""
        entries = [entry for index in self._accepted.pop(request_key, [])
                   if (entry := self._corrections.pop(index, None)) is not None]
        return entries, self._fallbacks.pop(request_key, [])

    def clear(self) -> None:
        self._corrections.clear()
        self._accepted.clear()
        self._fallbacks.clear()
