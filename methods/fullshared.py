"""FullShared: reuse the source agent's K/V of every shared (PH) segment, re-aligned to the new
positions, with no correction. The fastest and least accurate reuse: the upper bound on speed."""

from __future__ import annotations

from kvbench.methods.api.base import SharingMethod
from kvbench.methods.specs.fullshared import SPEC


class FullShared(SharingMethod, spec=SPEC):
    """The method `SPEC` declares, as its module docstring describes."""
