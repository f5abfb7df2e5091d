"""NonShared: every agent prefills its whole prompt with plain vLLM (no connector). vLLM's own
prefix cache still reuses each agent's own earlier prefix. The dense reference of every
quality figure."""

from __future__ import annotations

from kvbench.methods.base import SharingMethod
from kvbench.methods.registry import register_method


@register_method
class NonShared(SharingMethod):
    name = "nonshared"
    summary = ("plain vLLM prefill of every prompt (vLLM's own prefix cache still reuses each agent's own "
               "prefix)")
    approximate = False
    uses_connector = False
