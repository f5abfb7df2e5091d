"""PolyKV: FullShared's reuse from a compressed segment store.
Its implementation: `kvbench.methods.polykv`."""

from __future__ import annotations

from pydantic import Field

from kvbench.methods.api.params import STORE_CODEC_HELP, MethodParams
from kvbench.methods.api.spec import MethodSpec


class PolyKVParams(MethodParams):
    store_codec: str = Field("polykv", description=STORE_CODEC_HELP)


SPEC = MethodSpec(
    name="polykv",
    summary="FullShared's reuse from a PolyKV-compressed segment store (int8 keys, FWHT + 3-bit Lloyd-Max values)",
    implementation="kvbench.methods.polykv:PolyKV",
    Params=PolyKVParams,
)
