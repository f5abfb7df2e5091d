"""RelayCaching (Geng et al., arXiv 2603.13289): reuse the earlier agents' K/V of every shared
segment (their decoded outputs included), and rectify it only in a band of middle layers:
- layers [0, start_layer): reused as is;
- layers [start_layer, det_layer]: every reused row is computed (from the residual stream its
  source saved entering start_layer; from the token embeddings when it is 0);
- at det_layer, the rows to rectify are I_dev | I_inf: value deviation d = 1 - cos(v_reused,
  v_fresh) >= tau_dev * mean(d), or attention received from the prompt's last `suffix_tokens`
  rows >= tau_inf * mean of it;
- layers (det_layer, end_layer]: only those rows are computed; after end_layer every row is reused.

The official code was not readable when this was written: the stages and Eq. 1, 5, 6, 9
come from a third-party port's comments, tau_dev 1.5, tau_inf 1.45 and 10 suffix tokens from
there too; start_layer 0 and the band's ends are this implementation's defaults. The detection
layer defaults to the model's first layer whose K/V depend on the context (1 in a standard model;
3 in kvbench's recall model, see cacheblend.py)."""

from __future__ import annotations

import torch

from kvbench.methods.api.base import LoadContext, SegmentReuse, SharingMethod, rows_digest
from kvbench.methods.droidspeak import with_saved_stream
from kvbench.methods.specs.relaycaching import SPEC


class RelayCaching(SharingMethod, spec=SPEC):
    def recompute_layers(self) -> tuple[int, int] | None:
        end = int(self.params["end_layer"])
        if end < 0:
            assert self.core is not None, "end_layer -1 needs the model's depth (bind first)"
            end = self.core.num_layers - 1
        return int(self.params["start_layer"]), end + 1

    def loads_every_request(self) -> bool:
        return int(self.params["start_layer"]) > 0  # a source saves the stream entering start_layer

    def check_layer(self) -> int | None:
        if self.params["det_layer"] is not None:
            return int(self.params["det_layer"])
        return self.default_check_layer()

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
