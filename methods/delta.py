"""Delta correction over the connector core: reuse a cache of each shared segment and add a
correction estimated from an online anchor pool (KVComm, KVCMAS and their variants).

A subclass sets three switches: `chained` (correct the source agent's materialized cache along
the workflow edge, KVCMAS) or not (correct a context-free reference prefilled on first sight,
KVComm); `low_rank` (anchors as truncated-SVD factors) or full-dimensional; `matching` (online
anchor matching with the entropy gate) or one fixed calibration per relation (GraphFlow).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.methods.anchors import AnchorPool, anchor_distances, gate_from_distances, interpolated_delta
from kvbench.methods.base import LoadContext, MethodConfigError, SegmentReuse, SharingMethod
from kvbench.methods.plan import PlanSegment
from kvbench.methods.store import SavedKV

MAX_REFERENCES = 256


def content_key(tokens: torch.Tensor) -> str:
    """Identity of a segment's content: trajectory ids repeat across runs and traces on a
    long-lived server, so a context-free reference is keyed by its tokens alone."""
    return hashlib.sha1(tokens.to(torch.int64).numpy().tobytes()).hexdigest()[:20]


@dataclass
class PendingAnchor:
    """A dense fallback's observation, turned into an anchor after the request's first token."""

    slot: str
    anchor_id: str
    edge: str
    source: SegmentReuse  # the rows the correction would have been applied to
    target_k: torch.Tensor  # the dense rows as computed [layers, n, H, hd], keys at the target positions
    target_v: torch.Tensor


@dataclass
class Fallback:
    segment: PlanSegment
    reuse: SegmentReuse
    edge: str


class DeltaCorrection(SharingMethod):
    chained: ClassVar[bool] = True
    low_rank: ClassVar[bool] = True
    matching: ClassVar[bool] = True
    correct_layer0: ClassVar[bool] = True
    threshold_name: ClassVar[str] = "tau"
    defaults: ClassVar[dict[str, Any]] = {"V": 10, "tau": 0.3, "r_c": 32, "r_delta": 32, "gate_tokens": 0}

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        self.pools: dict[str, AnchorPool] = {}
        self.references: OrderedDict[tuple[str, str], SavedKV] = OrderedDict()
        self.pending: list[PendingAnchor] = []
        self._corrections: dict[int, tuple[torch.Tensor, torch.Tensor, int, int]] = {}
        self._fallbacks: dict[str, list[Fallback]] = {}
        self.peak_bytes: dict[str, int] = {}

    def validate(self) -> None:
        p = self.params
        for name in ("V", "r_c", "r_delta"):
            if name in p and (not isinstance(p[name], int) or isinstance(p[name], bool) or p[name] < 1):
                raise MethodConfigError(f"{self.name}: {name} must be a positive integer, got {p[name]!r}")
        if "gate_tokens" in p and (not isinstance(p["gate_tokens"], int) or p["gate_tokens"] < 0):
            raise MethodConfigError(f"{self.name}: gate_tokens must be an integer >= 0, got {p['gate_tokens']!r}")
        threshold = p.get(self.threshold_name)
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0 <= threshold <= 1):
            raise MethodConfigError(f"{self.name}: {self.threshold_name} must be in [0, 1], got {threshold!r}")

    # -------------------------------------------------------------- geometry
    @staticmethod
    def _flat(x: torch.Tensor) -> torch.Tensor:
        """[layers, n, heads, head_dim] -> [layers, n, features], dtype kept."""
        return x.reshape(x.shape[0], x.shape[1], -1)

    def _source_rows(self, reuse: SegmentReuse, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The reused rows, keys in canonical (segment-local) positions, as [layers, n, D] in the
        source's dtype. `exact=False` rotates in that dtype (about 0.4% error): enough to match
        against anchors, whose distances are taken in bf16 anyway; an anchor's delta is the small
        difference of two caches and needs the exact rotation."""
        src = reuse.src
        if len(src) and int(src[-1]) - int(src[0]) == len(src) - 1 and bool((src[1:] > src[:-1]).all()):
            k, v = reuse.source.k[:, int(src[0]): int(src[-1]) + 1], reuse.source.v[:, int(src[0]): int(src[-1]) + 1]
        else:
            index = src.to(reuse.source.k.device)  # plans index on the CPU; the cache may be on a GPU
            k, v = reuse.source.k.index_select(1, index), reuse.source.v.index_select(1, index)
        canonical = reuse.dst - reuse.segment.start  # segment-local position of each row
        assert self.core is not None
        k = self.core.aligner.rotate(k, canonical - reuse.src, exact=exact)
        return self._flat(k), self._flat(v)

    # -------------------------------------------------------------- sources
    def _reference(self, ctx: LoadContext, segment: PlanSegment) -> SegmentReuse | None:
        """Non-chained: the segment's context-free reference, prefilled on first sight."""
        start, stop = max(segment.start, ctx.num_local), min(segment.start + segment.length, len(ctx.tokens))
        if stop <= start or start != segment.start:
            return None  # partly in vLLM's prefix cache or cut by the prompt end: leave to dense
        key = (segment.id, content_key(ctx.tokens[start:stop]))
        reference = self.references.get(key)
        if reference is None:
            assert self.core is not None
            started = time.perf_counter()
            reference = self.core.context_free_prefill(ctx.tokens[start:stop])
            ctx.stats["reference_prefill_s"] = ctx.stats.get("reference_prefill_s", 0.0) + time.perf_counter() - started
            ctx.stats["reference_tokens"] = ctx.stats.get("reference_tokens", 0) + (stop - start)
            self.references[key] = reference
            while len(self.references) > MAX_REFERENCES:
                self.references.popitem(last=False)
        else:
            self.references.move_to_end(key)
        dst = torch.arange(start, stop)
        return SegmentReuse(segment, reference, dst, dst - segment.start)

    # -------------------------------------------------------------- the method
    def select(self, ctx: LoadContext) -> list[SegmentReuse]:
        by_segment = {c.segment.id: c for c in ctx.candidates}
        chosen, decisions, eligible = [], [], 0
        # One load at a time: anything left from a load that failed midway is stale.
        self._corrections.clear()
        self._fallbacks = {ctx.request_key: []}
        fallbacks = self._fallbacks[ctx.request_key]
        for segment in ctx.plan.segments:
            if segment.kind != "ph":
                continue
            reuse = by_segment.get(segment.id) if self.chained else self._reference(ctx, segment)
            if reuse is None:
                continue
            eligible += len(reuse.dst)
            started = time.perf_counter()
            source = segment.source_agent if self.chained else "ref"
            edge = f"{source}->{ctx.plan.agent}"
            current_k, current_v = self._source_rows(reuse, exact=False)
            rows_s = time.perf_counter() - started
            decision = self._decide(segment.id, edge, current_k, current_v)
            decision.update(id=segment.id, rows_s=rows_s)
            if decision.pop("accept"):
                delta_k, delta_v, covered = decision.pop("delta")
                self._corrections[id(reuse)] = (delta_k, delta_v, covered, segment.start)
                chosen.append(reuse)
            else:
                fallbacks.append(Fallback(segment, reuse, edge))
            decision["decide_s"] = time.perf_counter() - started
            decisions.append(decision)
        ctx.stats["eligible_tokens"] = eligible
        ctx.stats["decisions"] = decisions
        return chosen

    def threshold(self) -> float:
        return float(self.params[self.threshold_name])

    def _decide(self, slot: str, edge: str, current_k: torch.Tensor, current_v: torch.Tensor) -> dict[str, Any]:
        pool = self.pools.setdefault(slot, AnchorPool(int(self.params.get("V", 1))))
        n = current_v.shape[1]
        compatible = pool.compatible(edge, min_length=1)
        if not self.matching:  # one calibrated correction per relation, applied without matching
            if not compatible:
                return {"accept": False, "decision": "calibrate"}
            anchor = compatible[0]
            covered = min(n, anchor.covers(edge))
            anchor.uses += 1
            return {"accept": True, "decision": "accepted", "anchors": 1, "covered": covered,
                    "delta": (anchor.deltas[edge][0].rows(covered), anchor.deltas[edge][1].rows(covered), covered)}
        # The correction covers the longest prefix the anchors hold (rows past it keep the
        # re-aligned source cache rather than extrapolating a correction); the gate compares the
        # first k rows of it (gate_tokens; 0 = all covered rows).
        covered = min(n, max((a.covers(edge) for a in compatible), default=0))
        eligible = [a for a in compatible if a.covers(edge) >= covered]
        if len(eligible) < 2:
            return {"accept": False, "decision": "dense_few_anchors", "anchors": len(eligible)}
        k = min(covered, int(self.params.get("gate_tokens") or covered))
        # One pass over the value states serves the gate (Eq. 9, first k rows) and, on accept,
        # the token-wise value weights (all covered rows).
        started = time.perf_counter()
        value_distances, value_squares = anchor_distances(current_v, [a.base_v for a in eligible], covered,
                                                          gate_rows=k)
        assert self.core is not None
        ranks = self.core.tensor_parallel_size
        if ranks > 1:  # each rank holds some heads: the gate and weights are over all of them
            summed = self.core.sum_over_ranks(torch.cat((value_distances.flatten(), value_squares)))
            value_distances, value_squares = summed[:value_distances.numel()].view_as(value_distances), \
                summed[value_distances.numel():]
        gate = gate_from_distances(value_squares, self.threshold())
        gate_s = time.perf_counter() - started
        if not gate.accept:
            return {"accept": False, "decision": "dense_gate", "entropy": gate.normalized_entropy,
                    "anchors": len(eligible), "gate_s": gate_s}
        delta_k, delta_v = interpolated_delta(current_k, current_v, eligible, edge, covered,
                                              value_distances=value_distances,
                                              sum_over_ranks=self.core.sum_over_ranks if ranks > 1 else None,
                                              ranks=ranks)
        interpolate_s = time.perf_counter() - started - gate_s
        order = torch.argsort(gate.weights, descending=True)
        mass = 0.0
        for index in order.tolist():  # count a use for the anchors holding 90% of the gate mass
            eligible[index].uses += 1
            mass += float(gate.weights[index])
            if mass >= 0.9:
                break
        return {"accept": True, "decision": "accepted", "entropy": gate.normalized_entropy, "anchors": len(eligible),
                "covered": covered, "delta": (delta_k, delta_v, covered), "gate_s": gate_s,
                "interpolate_s": interpolate_s}

    def correct(self, layer: int, reuse: SegmentReuse, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._corrections.get(id(reuse))
        if entry is None or (layer == 0 and not self.correct_layer0):
            return keys, values
        delta_k, delta_v, covered, segment_start = entry
        heads, head_dim = keys.shape[1], keys.shape[2]
        assert self.core is not None
        # Corrections live in canonical positions: turn them to the target positions (RoPE is
        # linear). A correction is a few percent of the key, so the rotation's bf16 error is noise.
        dk = self.core.aligner.rotate(delta_k[layer].view(covered, heads, head_dim), segment_start, exact=False)
        # keys/values are the caller's fresh copies (SharingMethod.correct): added in place; bf16 +
        # bf16 adds in fp32 and rounds once, like the fp32 sum cast back.
        keys[:covered] += dk.to(keys.dtype)
        values[:covered] += delta_v[layer].view(covered, heads, head_dim).to(values.dtype)
        return keys, values

    def after_load(self, ctx: LoadContext) -> None:
        self._corrections.clear()
        for fallback in self._fallbacks.pop(ctx.request_key, []):
            # The segment was computed densely: its exact cache against the (aligned) source gives
            # the correction this edge needed. Only the target rows are read now (their blocks
            # belong to this request); rotations and factorization wait for run_deferred, after
            # the first token.
            target_k, target_v = ctx.read_rows(fallback.reuse.dst)
            # One anchor per observation (trajectory) of a slot, shared by the edges along it; the
            # content key keeps a stale anchor of another run's trajectory with the same id apart.
            segment = fallback.segment
            content = content_key(ctx.tokens[segment.start: segment.start + segment.length])
            self.pending.append(PendingAnchor(segment.id, f"{ctx.plan.trajectory}/{content}", fallback.edge,
                                              fallback.reuse, target_k, target_v))

    def run_deferred(self) -> None:
        rank_base = int(self.params["r_c"]) if self.low_rank else None
        rank_delta = int(self.params["r_delta"]) if self.low_rank else None
        jobs, self.pending = self.pending, []
        for job in jobs:
            pool = self.pools.setdefault(job.slot, AnchorPool(int(self.params.get("V", 1))))
            anchor_id = job.anchor_id
            if not self.matching:
                if pool.compatible(job.edge, 1):
                    continue  # this relation is calibrated already
                anchor_id = "calibration"  # one correction per (slot, target agent), whatever the content
            assert self.core is not None
            source_k, source_v = (x.float() for x in self._source_rows(job.source, exact=True))
            # Target rows sit at dst = segment.start + canonical position: one constant shift back.
            target_k = self._flat(self.core.aligner.rotate(job.target_k, -job.source.segment.start)).float()
            target_v = self._flat(job.target_v).float()
            pool.add(anchor_id, job.edge, source_k, source_v, target_k - source_k, target_v - source_v,
                     rank_base, rank_delta, torch.bfloat16)
        self._track_peak()

    # -------------------------------------------------------------- accounting
    def state_bytes(self) -> dict[str, int]:
        current = {"anchor_pool": sum(p.nbytes for p in self.pools.values()),
                   "references": sum(r.nbytes for r in self.references.values())}
        self._track_peak(current)
        return {**current, **{f"peak_{k}": v for k, v in self.peak_bytes.items()}}

    def _track_peak(self, current: dict[str, int] | None = None) -> None:
        current = current or {"anchor_pool": sum(p.nbytes for p in self.pools.values()),
                              "references": sum(r.nbytes for r in self.references.values())}
        for key, value in current.items():
            self.peak_bytes[key] = max(self.peak_bytes.get(key, 0), value)

    def reset(self) -> None:
        self.pools.clear()
        self.references.clear()
        self.pending.clear()
        self._corrections.clear()
        self._fallbacks.clear()
        self.peak_bytes.clear()
