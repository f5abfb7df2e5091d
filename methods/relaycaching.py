"""RelayCaching (Geng et al., arXiv 2603.13289): reuse the earlier agents' K/V of every shared
segment (their decoded outputs included), and rectify it only in a band of middle layers:
- layers [0, start_layer): reused as is;
- layers [start_layer, det_layer]: every reused row is computed (from the residual stream its
  source saved entering start_layer; from the token embeddings when it is 0);
- at det_layer, the rows to rectify are I_dev | I_inf: value deviation d = 1 - cos(v_reused,
  v_fresh) >= tau_dev * mean(d), or attention received from the prompt's last `suffix_tokens`
  rows >= tau_inf * mean of it;
- layers (det_layer, end_layer]: only those rows are computed; after end_layer every row is reused.

The official code was not readable (peer-methods.md section 3.2): the stages and Eq. 1, 5, 6, 9
come from a third-party port's comments, tau_dev 1.5, tau_inf 1.45 and 10 suffix tokens from
there too; start_layer 0 and the band's ends are this implementation's defaults."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvbench.methods.base import LoadContext, MethodConfigError, SegmentReuse, SharingMethod, rows_digest
from kvbench.methods.droidspeak import with_saved_stream


class RelayCaching(SharingMethod):
    name = "relaycaching"
    defaults: ClassVar[dict[str, Any]] = {"start_layer": 0, "det_layer": 1, "end_layer": -1, "tau_dev": 1.5,
                                          "tau_inf": 1.45, "suffix_tokens": 10}

    def validate(self) -> None:
        p = self.params
        for name in ("start_layer", "det_layer", "suffix_tokens"):
            if not isinstance(p[name], int) or isinstance(p[name], bool) or p[name] < 0:
                raise MethodConfigError(f"relaycaching: {name} must be an integer >= 0, got {p[name]!r}")
        if not isinstance(p["end_layer"], int) or isinstance(p["end_layer"], bool) or p["end_layer"] < -1:
            raise MethodConfigError(f"relaycaching: end_layer must be a layer index or -1 (the last), got {p['end_layer']!r}")
        if not p["start_layer"] <= p["det_layer"]:
            raise MethodConfigError(f"relaycaching: start_layer ({p['start_layer']}) must be <= det_layer ({p['det_layer']})")
        for name in ("tau_dev", "tau_inf"):
            if not isinstance(p[name], int | float) or p[name] < 0:
                raise MethodConfigError(f"relaycaching: {name} must be a number >= 0, got {p[name]!r}")

    def recompute_layers(self) -> tuple[int, int] | None:
        end = int(self.params["end_layer"])
        if end < 0:
            assert self.core is not None, "end_layer -1 needs the model's depth (bind first)"
            end = self.core.num_layers - 1
        return int(self.params["start_layer"]), end + 1

    def check_layer(self) -> int | None:
        return int(self.params["det_layer"])

    def influence_queries(self) -> int:
        return int(self.params["suffix_tokens"])

    def select(self, ctx: LoadContext) -> list[SegmentReuse]:
        return with_saved_stream(ctx, int(self.params["start_layer"]))

    def recompute(self, ctx: LoadContext, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
                  reused_k: torch.Tensor, reused_v: torch.Tensor, influence: torch.Tensor | None = None) -> torch.Tensor:
        fresh, reused = fresh_v.flatten(1).float(), reused_v.flatten(1).float()
        # Eq. 1, one per token, over all heads: the dot product and norms are summed over the
        # tensor-parallel ranks (each holds some heads) so that every rank picks the same rows.
        assert self.core is not None
        sums = self.core.sum_over_ranks(torch.stack(((fresh * reused).sum(1), fresh.square().sum(1),
                                                     reused.square().sum(1))))
        deviation = 1 - sums[0] / (sums[1].sqrt() * sums[2].sqrt()).clamp_min(1e-8)
        by_deviation = deviation >= float(self.params["tau_dev"]) * deviation.mean()  # Eq. 5
        by_influence = torch.zeros_like(by_deviation)
        if influence is not None and len(influence):
            influence = influence.to(deviation.device)
            by_influence = influence >= float(self.params["tau_inf"]) * influence.mean()  # Eq. 6
        picked = by_deviation | by_influence  # Eq. 9
        ctx.stats["relay"] = {"det_layer": layer, "candidate_tokens": len(picked), "picked_tokens": int(picked.sum()),
                              "deviation_tokens": int(by_deviation.sum()), "influence_tokens": int(by_influence.sum()),
                              "picked_digest": rows_digest(picked)}
        return picked
