"""FullShared: reuse the source agent's K/V of every shared (PH) segment, re-aligned to the new
positions, with no correction. The fastest and least accurate reuse: the upper bound on speed."""

from __future__ import annotations

from kvbench.methods.base import SharingMethod
from kvbench.methods.registry import register_method


@register_method
class FullShared(SharingMethod):
    name = "fullshared"
    summary = "reuse the source agent's K/V of every shared segment, re-aligned, no correction"
