"""CacheBlend (Yao et al., EuroSys'25): reuse the source agent's K/V of every shared segment, but
compute every row through the first layers; at the check layer, keep recomputing only the reused
tokens whose K/V deviates most from the fresh one (and the rows no source held) in the layers
after it. The deviation is taken on values, summed over heads and channels, as in CacheBlend's
own code (LMCache's port uses keys: `deviation="key"`); the paper recomputes 15-16% of tokens
at check layer 1 (as the CacheBlend paper reports), the first layer whose K/V depend on the context.
The default check layer is that layer of the model served: 1 in a standard model, 3 in kvbench's
recall model, whose hand-set layers 0-2 attend only to a row's ~10 predecessors (their K/V differ
between agents only on a segment's first rows, so a check there would pick tokens at random)."""

from __future__ import annotations

import math

import torch

from kvbench.methods.api.base import LoadContext, SharingMethod, rows_digest
from kvbench.methods.specs.cacheblend import SPEC


class CacheBlend(SharingMethod, spec=SPEC):
    def check_layer(self) -> int | None:
        if self.params["check_layer"] is not None:
            return int(self.params["check_layer"])
        return self.default_check_layer()

    def check_layers(self) -> list[int]:
        check = self.check_layer()
        return [] if check is None else list(range(check, check + 1 + len(self.params["filter_ratios"])))

    def recompute(self, ctx: LoadContext, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
                  reused_k: torch.Tensor, reused_v: torch.Tensor, influence: torch.Tensor | None = None) -> torch.Tensor:
        fresh, reused = (fresh_v, reused_v) if self.params["deviation"] == "value" else (fresh_k, reused_k)
        deviation = (fresh.float() - reused.float()).square().sum(dim=(1, 2))  # one value per token
        assert self.core is not None
        deviation = self.core.sum_over_ranks(deviation)  # over every rank's heads: all ranks pick alike
        # Shares are of the reused tokens at the check layer; a later layer picks among the rows the
        # one before kept, never more than recompute_ratio's final share below.
        ratios = [*self.params["filter_ratios"], self.params["recompute_ratio"]]
        step = layer - self.check_layers()[0]
        first = ctx.stats.setdefault("blend", {"check_layer": layer, "candidate_tokens": len(deviation)})
        share = max(float(ratios[step]), float(self.params["recompute_ratio"]))
        count = min(len(deviation), math.ceil(share * first["candidate_tokens"]))
        picked = torch.zeros(len(deviation), dtype=torch.bool, device=deviation.device)
        picked[torch.topk(deviation, count).indices] = True
        first.update({"picked_tokens": count, "picked_digest": rows_digest(picked),
                      "deviation_picked_share": float(deviation[picked].sum() / deviation.sum().clamp_min(1e-30))})
        if len(ratios) > 1:
            first.setdefault("filtered", []).append({"layer": layer, "kept_tokens": count})
        return picked
