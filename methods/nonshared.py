"""NonShared: every agent prefills its whole prompt with plain vLLM (no connector). vLLM's own
prefix cache still reuses each agent's own earlier prefix. The dense reference of every
quality figure."""

from __future__ import annotations

from kvbench.methods.api.base import SharingMethod
from kvbench.methods.specs.nonshared import SPEC


class NonShared(SharingMethod, spec=SPEC):
    """The method `SPEC` declares, as its module docstring describes."""
