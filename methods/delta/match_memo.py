"""Memoized anchor distances of one source segment (delta correction's matching).

The gate (Eq. 9-11) and the token-wise weights depend only on the rows a correction starts from
and on the anchors' base caches, not on the agent that reads them. So the distances of one
source segment to one anchor base are computed once and kept: a context-free reference is
matched once for all agents that read it, and a chained source's segment can be matched as soon
as its rows are final (after the producing request's first token), ahead of the edge that will
read it. Distances are kept per anchor (by its serial), so anchors added later are computed on
demand and evicted ones are simply never asked for. Each rank keeps its own partial sums (its
KV heads); decisions still sum them over ranks where they are taken.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from kvbench.methods.delta.anchors import Anchor, anchor_distances
from kvbench.methods.delta.jobs import Rows

# Distances of this many source segments are kept (least recently used dropped first). An 8K
# segment against 10 anchors takes 3 x 10 x 8192 fp32 values (1 MiB).
MAX_MEMO_SEGMENTS = 128


@dataclass
class SegmentDistances:
    """One source segment's distances to anchor bases (this rank's share of the heads)."""

    rows: int  # the segment rows the distances cover, from its first (canonical position 0)
    # Values of the first, middle and last row ([layers, 3, D]) the distances were taken from:
    # a consumer checks them against the cache it actually reads before trusting the entry.
    check: torch.Tensor | None = None
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # serial -> [2, m]: L1 per token, squares per row
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # serial -> [m]: L1 per token

    @staticmethod
    def check_rows(rows: int) -> torch.Tensor:
        return torch.tensor(sorted({0, rows // 2, rows - 1}), dtype=torch.long)

    def matches(self, values: torch.Tensor, start: int) -> bool:
        """Whether the cache `values` [layers, tokens, H, hd] holds, from row `start` on, the rows
        these distances describe (only the checked rows are read); always, without a check (a
        reference is its own identity)."""
        if self.check is None:
            return True
        index = self.check_rows(self.rows) + start
        if values.shape[1] <= int(index[-1]):
            return False
        rows = values.index_select(1, index.to(values.device))
        return bool(torch.equal(rows.reshape(*self.check.shape), self.check))

    @property
    def nbytes(self) -> int:
        check = 0 if self.check is None else self.check.nbytes
        return check + sum(t.nbytes for t in self.values.values()) + sum(t.nbytes for t in self.keys.values())


class MatchMemo:
    """SegmentDistances by source segment, least recently used dropped first."""

    def __init__(self, capacity: int = MAX_MEMO_SEGMENTS) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[Hashable, SegmentDistances] = OrderedDict()

    def get(self, key: Hashable) -> SegmentDistances | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: Hashable, entry: SegmentDistances) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def drop(self, key: Hashable) -> None:
        self.entries.pop(key, None)

    def clear(self) -> None:
        self.entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


def memoized_distances(anchors: list[Anchor], n: int, rows: Callable[[], Rows], memo: SegmentDistances | None,
                       keys: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's distances of the source's first n rows to each anchor's base, values
    ([anchors, n] L1 per token, [anchors, n] squares per row) or keys (L1; no squares): kept
    ones from `memo`, the others computed (from `rows`) and kept there. Also how many were kept."""
    table = None if memo is None else (memo.keys if keys else memo.values)
    kept = {i: table[a.serial] for i, a in enumerate(anchors)
            if table is not None and a.serial in table and table[a.serial].shape[-1] >= n}
    missing = [i for i in range(len(anchors)) if i not in kept]
    computed_l1 = computed_sq = None
    if missing:
        current_k, current_v = rows()
        bases = [anchors[i].base_k if keys else anchors[i].base_v for i in missing]
        computed_l1, computed_sq = anchor_distances(current_k if keys else current_v, bases, n,
                                                    gate_rows=0 if keys else n, squares_per_row=not keys)
        if table is not None:
            for j, i in enumerate(missing):
                table[anchors[i].serial] = (computed_l1[j].clone() if keys
                                            else torch.stack((computed_l1[j], computed_sq[j])))
    if not kept:
        return computed_l1, computed_sq, 0  # type: ignore[return-value]
    device = next(iter(kept.values())).device
    l1 = torch.empty(len(anchors), n, device=device)
    squares = None if keys else torch.empty(len(anchors), n, device=device)
    for i, stored in kept.items():
        if keys:
            l1[i] = stored[:n]
        else:
            l1[i], squares[i] = stored[0, :n], stored[1, :n]  # type: ignore[index]
    for j, i in enumerate(missing):
        l1[i] = computed_l1[j]  # type: ignore[index]
        if not keys:
            squares[i] = computed_sq[j]  # type: ignore[index]
    return l1, squares, len(kept)  # type: ignore[return-value]
