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

from kvbench.methods.api.base import LoadContext, SegmentReuse, SharingMethod
from kvbench.methods.specs.droidspeak import SPEC


class DroidSpeak(SharingMethod, spec=SPEC):

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
