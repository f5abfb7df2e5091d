"""DroidSpeak: one contiguous layer group recomputed for every shared token.
Its implementation: `kvbench.methods.droidspeak`."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvbench.methods.api.params import MethodParams
from kvbench.methods.api.spec import MethodSpec


class DroidSpeakParams(MethodParams):
    layers: list[int] | None = Field(None, description="the recomputed layer group [start, stop); default: the "
                                     "deepest round((1 - reuse_ratio) * L) layers, at least 2")
    reuse_ratio: float = Field(0.8, ge=0, lt=1, description="share of the layers that keep the reused K/V "
                               "(sizes the default group)")

    @field_validator("layers")
    @classmethod
    def _a_layer_range(cls, layers: list[int] | None) -> list[int] | None:
        if layers is not None and not (len(layers) == 2 and 0 <= layers[0] < layers[1]):
            raise ValueError("layers must be [start, stop) with 0 <= start < stop")
        return layers


SPEC = MethodSpec(
    name="droidspeak",
    summary=("reuse, then recompute one contiguous layer group for all shared tokens from the source's saved "
             "residual stream (deepest 20% of layers, at least 2)"),
    implementation="kvbench.methods.droidspeak:DroidSpeak",
    Params=DroidSpeakParams,
    layer_profiled=True,
)
