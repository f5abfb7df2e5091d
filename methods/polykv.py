"""PolyKV: one compressed shared pool. FullShared's reuse (every shared segment from the source
agent's cache, keys re-rotated), with the segment store holding PolyKV-compressed K/V: compressed
once when a turn is saved, decompressed when a reuse turn loads it. `store_codec` picks the
codec's variant (kvbench.methods.core.kv_codec); `polykv-published` is the scheme exactly as published
(one index per int8, fp32 norms), `identity` turns compression off (then it is FullShared)."""

from __future__ import annotations

from kvbench.methods.fullshared import FullShared
from kvbench.methods.specs.polykv import SPEC


class PolyKV(FullShared, spec=SPEC):
    """The method `SPEC` declares, as its module docstring describes."""
