"""RelayCaching: a band of middle layers rectified for the rows that deviate or are attended to.
Its implementation: `kvbench.methods.relaycaching`."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvbench.methods.api.params import MethodParams
from kvbench.methods.api.spec import MethodSpec


class RelayCachingParams(MethodParams):
    start_layer: int = Field(0, ge=0, description="first layer of the rectified band")
    det_layer: int | None = Field(None, ge=0, description="layer where the rows to rectify are detected "
                                  "(default: the model's first layer whose K/V depend on the context, 1 in a "
                                  "standard model)")
    end_layer: int = Field(-1, ge=-1, description="last layer of the band (-1: the model's last)")
    tau_dev: float = Field(1.5, ge=0, description="rectify rows whose value deviation >= tau_dev * its mean")
    tau_inf: float = Field(1.45, ge=0, description="rectify rows whose received attention >= tau_inf * its mean")
    suffix_tokens: int = Field(10, ge=0, description="the prompt's last rows whose attention is measured")

    @model_validator(mode="after")
    def _band_in_order(self) -> RelayCachingParams:
        if self.det_layer is not None and self.start_layer > self.det_layer:
            raise ValueError(f"start_layer ({self.start_layer}) must be <= det_layer ({self.det_layer})")
        return self


SPEC = MethodSpec(
    name="relaycaching",
    summary=("reuse, compute every reused row through det_layer (the first context-dependent layer: 1), then "
             "only those whose values deviate or that the prompt's tail attends to, up to end_layer"),
    implementation="kvbench.methods.relaycaching:RelayCaching",
    Params=RelayCachingParams,
    # `kvbench calibrate --method relaycaching --target-rho R`: a higher deviation threshold picks
    # fewer rows to rectify, so rho rises with it (the official rho 0.8-0.9 is reached so).
    threshold_name="tau_dev",
    threshold_range=(0.0, 20.0),
)
