"""NonShared: plain vLLM, the dense reference of every quality figure.
Its implementation: `kvbench.methods.nonshared`."""

from __future__ import annotations

from kvbench.methods.api.spec import MethodSpec

SPEC = MethodSpec(
    name="nonshared",
    summary=("plain vLLM prefill of every prompt (vLLM's own prefix cache still reuses each agent's own "
             "prefix)"),
    implementation="kvbench.methods.nonshared:NonShared",
    approximate=False,
    uses_connector=False,
)
