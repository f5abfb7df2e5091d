"""DroidSpeak (Liu et al., NSDI'26) for agents of one model: reuse the source agent's K/V of every
shared segment, but recompute one contiguous group of layers [start, stop) for all shared
tokens, starting from the residual stream the source computed entering `start` (its "E-cache",
saved with its cache). Layers outside the group keep the reused K/V.

With one model for all agents, the group's first layer gets the source's own K/V back (they are
a function of the entering stream alone); the layers after it see the target's context through
attention. So a group of width w corrects w - 1 layers, and a group starting at layer 0 (entering
with the token embeddings) is exact in every layer of it. DroidSpeak chooses the group by offline
profiling of layer-wise deviation (`kvbench calibrate --method droidspeak`); without `layers`,
the default is the deepest group of round((1 - reuse_ratio) * L) layers, at least 2: reuse
error grows with depth, and a 1-layer group would change nothing.

Shared rows whose source has no saved stream (its generated tokens, which vLLM computed itself,
or a source that vLLM prefilled without the connector) are computed densely."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from kvbench.methods.base import LoadContext, MethodParams, SegmentReuse, SharingMethod
from kvbench.methods.registry import register_method


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


@register_method
class DroidSpeak(SharingMethod):
    name = "droidspeak"
    summary = ("reuse, then recompute one contiguous layer group for all shared tokens from the source's saved "
               "residual stream (deepest 20% of layers, at least 2)")
    Params = DroidSpeakParams
    layer_profiled: ClassVar[bool] = True  # `kvbench calibrate` profiles its layer group

    def recompute_layers(self) -> tuple[int, int] | None:
        if self.params["layers"] is not None:
            start, stop = self.params["layers"]
            return int(start), int(stop)
        assert self.core is not None, "the default layer group needs the model's depth (bind first)"
        total = self.core.num_layers
        width = min(total, max(2, round((1 - float(self.params["reuse_ratio"])) * total)))
        return total - width, total

    def loads_every_request(self) -> bool:
        # A source saves the residual stream entering the group, which only its load captures
        # (the default group starts past layer 0 in every model of more than two layers).
        layers = self.params["layers"]
        return layers is None or int(layers[0]) > 0

    def select(self, ctx: LoadContext) -> list[SegmentReuse]:
        return with_saved_stream(ctx, self.recompute_layers()[0])  # type: ignore[index]


def with_saved_stream(ctx: LoadContext, layer: int) -> list[SegmentReuse]:
    """The candidate rows whose source saved its residual stream entering `layer` (all of them at
    layer 0, where token embeddings enter); the others are left to dense computation and counted
    in `dense_without_stream_tokens`."""
    if layer == 0:
        return ctx.candidates
    chosen, without = [], 0
    for candidate in ctx.candidates:
        source = candidate.source
        if source.hidden is None or source.hidden_layer != layer:
            without += len(candidate.dst)
            continue
        ok = source.hidden_valid[candidate.src]  # type: ignore[index]
        without += int((~ok).sum())
        if bool(ok.any()):
            chosen.append(SegmentReuse(candidate.segment, source, candidate.dst[ok], candidate.src[ok]))
    ctx.stats["dense_without_stream_tokens"] = without
    return chosen
