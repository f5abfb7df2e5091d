"""CacheBlend: selective recomputation of the reused tokens that deviate most.
Its implementation: `kvbench.methods.cacheblend`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvbench.methods.api.params import MethodParams
from kvbench.methods.api.spec import MethodSpec


class CacheBlendParams(MethodParams):
    recompute_ratio: float = Field(0.15, ge=0, le=1, description="share of the reused tokens recomputed after "
                                   "the check layer (those that deviate most)")
    check_layer: int | None = Field(None, ge=0, description="layer where fresh and reused K/V are compared "
                                    "(default: the model's first layer whose K/V depend on the context, 1 "
                                    "in a standard model)")
    deviation: Literal["value", "key"] = Field("value", description="compare values (CacheBlend's code) or keys "
                                               "(LMCache's port)")
    filter_ratios: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        [], max_length=8, description="gradual filtering (CacheBlend's paper, section 4.3): shares of the reused "
        "tokens kept computing after the check layer and each next layer, each chosen among those the layer "
        "before kept, before recompute_ratio applies one layer later; e.g. [0.3] with check layer 1 keeps 30% "
        "through layer 2 and 15% after it. Empty: one selection at the check layer (CacheBlend's code)")


SPEC = MethodSpec(
    name="cacheblend",
    summary=("reuse, then recompute the 15% of reused tokens whose values deviate most at the first "
             "context-dependent layer (1) through the later layers"),
    implementation="kvbench.methods.cacheblend:CacheBlend",
    Params=CacheBlendParams,
    # `kvbench calibrate --method cacheblend --target-rho R`: the recomputed share of reused tokens
    # for a reuse ratio (rho falls as it grows); its recompute share of entries follows from it and
    # the check layer: (check + 1) / L + ratio * (L - check - 1) / L.
    threshold_name="recompute_ratio",
    rho_rises_with_threshold=False,
)
