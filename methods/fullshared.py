"""FullShared: reuse the source agent's K/V of every shared (PH) segment, re-aligned to the new
positions, with no correction. The fastest and least accurate reuse: the upper bound on speed."""

from __future__ import annotations

from kvbench.methods.base import SharingMethod


class FullShared(SharingMethod):
    name = "fullshared"
