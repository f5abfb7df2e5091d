"""PolyKV: one compressed shared pool. FullShared's reuse (every shared segment from the source
agent's cache, keys re-rotated), with the segment store holding PolyKV-compressed K/V: compressed
once when a turn is saved, decompressed when a reuse turn loads it. `store_codec` picks the
codec's variant (kvbench.methods.connector.kv_codec); `polykv-published` is the scheme exactly as published
(one index per int8, fp32 norms), `identity` turns compression off (then it is FullShared)."""

from __future__ import annotations

from pydantic import Field

from kvbench.methods.fullshared import FullShared
from kvbench.methods.params import STORE_CODEC_HELP, MethodParams
from kvbench.methods.registry import register_method


class PolyKVParams(MethodParams):
    store_codec: str = Field("polykv", description=STORE_CODEC_HELP)


@register_method
class PolyKV(FullShared):
    name = "polykv"
    summary = "FullShared's reuse from a PolyKV-compressed segment store (int8 keys, FWHT + 3-bit Lloyd-Max values)"
    Params = PolyKVParams
