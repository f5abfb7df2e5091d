"""CacheBlend (Yao et al., EuroSys'25): reuse the source agent's K/V of every shared segment, but
compute every row through the first layers; at the check layer, keep recomputing only the reused
tokens whose K/V deviates most from the fresh one (and the rows no source held) in the layers
after it. The deviation is taken on values, summed over heads and channels, as in CacheBlend's
own code (LMCache's port uses keys: `deviation="key"`); the paper recomputes 15-16% of tokens
at check layer 1 (peer-methods.md section 2.6)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from kvbench.methods.base import LoadContext, MethodConfigError, SharingMethod, rows_digest


class CacheBlend(SharingMethod):
    name = "cacheblend"
    defaults: ClassVar[dict[str, Any]] = {"recompute_ratio": 0.15, "check_layer": 1, "deviation": "value"}

    def validate(self) -> None:
        ratio, check = self.params["recompute_ratio"], self.params["check_layer"]
        if not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            raise MethodConfigError(f"cacheblend: recompute_ratio must be in [0, 1], got {ratio!r}")
        if not isinstance(check, int) or check < 0:
            raise MethodConfigError(f"cacheblend: check_layer must be an integer >= 0, got {check!r}")
        if self.params["deviation"] not in ("value", "key"):
            raise MethodConfigError(f"cacheblend: deviation must be 'value' or 'key', got {self.params['deviation']!r}")

    def check_layer(self) -> int | None:
        return int(self.params["check_layer"])

    def recompute(self, ctx: LoadContext, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
                  reused_k: torch.Tensor, reused_v: torch.Tensor, influence: torch.Tensor | None = None) -> torch.Tensor:
        fresh, reused = (fresh_v, reused_v) if self.params["deviation"] == "value" else (fresh_k, reused_k)
        deviation = (fresh.float() - reused.float()).square().sum(dim=(1, 2))  # one value per token
        assert self.core is not None
        deviation = self.core.sum_over_ranks(deviation)  # over every rank's heads: all ranks pick alike
        count = min(len(deviation), math.ceil(float(self.params["recompute_ratio"]) * len(deviation)))
        picked = torch.zeros(len(deviation), dtype=torch.bool, device=deviation.device)
        picked[torch.topk(deviation, count).indices] = True
        ctx.stats["blend"] = {"check_layer": layer, "picked_tokens": count, "candidate_tokens": len(deviation),
                              "picked_digest": rows_digest(picked),
                              "deviation_picked_share": float(deviation[picked].sum() / deviation.sum().clamp_min(1e-30))}
        return picked
