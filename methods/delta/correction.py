"""Delta correction over the connector core: reuse a cache of each shared segment and add a
correction estimated from an online anchor pool (KVComm, KVCMAS and their variants).

A subclass sets three switches: `chained` (correct the source agent's materialized cache along
the workflow edge, KVCMAS) or not (correct a context-free reference prefilled on first sight,
KVComm); `low_rank` (anchors as truncated-SVD factors) or full-dimensional; `matching` (online
anchor matching with the entropy gate) or one fixed calibration per relation (GraphFlow).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from typing import Any, ClassVar

import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.api.base import CoreServices, LoadContext, SegmentReuse, SharingMethod
from kvbench.methods.core.kv_codec import make_codec
from kvbench.methods.delta.anchors import (
    Anchor,
    AnchorPool,
    Correction,
    edge_source,
    gate_from_distances,
    token_weighted_corrections,
)
from kvbench.methods.delta.geometry import canonical_source_rows, flat, observed_rows
from kvbench.methods.delta.jobs import (
    AcceptedCorrection,
    Fallback,
    LazyRows,
    OpenDecisions,
    PendingAnchor,
    Prematch,
    Rows,
)
from kvbench.methods.delta.match_memo import MatchMemo, SegmentDistances, memoized_distances
from kvbench.methods.delta.references import ContextFreeReferences, content_key
from kvbench.methods.delta.shared_anchors import AnchorExchange
from kvbench.methods.delta.stored import BaseCodec

OUTPUT_SEGMENT_PREFIX = "out:"  # an agent's output segment (kvbench.tracegen.schema.OUT_PREFIX)

logger = logging.getLogger("kvbench.methods.delta.correction")


class DeltaCorrection(SharingMethod):
    chained: ClassVar[bool] = True
    # A gate may send segments dense: decided before the claim, so that vLLM prefills what it sends
    # dense after the last reused row (and a turn it sends wholly dense, as NonShared would).
    decides_before_claim: ClassVar[bool] = True
    low_rank: ClassVar[bool] = True
    matching: ClassVar[bool] = True
    correct_layer0: ClassVar[bool] = True
    # KVComm's code (kvcomm-ref), where the KVCMAS paper's description differs: a context-free
    # reference is prefilled after the prompt's own prefix (BOS; the segment's first token is then
    # no attention sink), an agent's output is corrected from its producer's decode-phase cache
    # rather than a reference, and one rejected segment sends the whole agent dense.
    reference_prefix: ClassVar[bool] = False
    outputs_from_producer: ClassVar[bool] = False
    whole_agent_fallback: ClassVar[bool] = False
    # KVComm (its code and its description): a segment longer than every anchor but one goes dense
    # (only anchors covering the whole placeholder match); KVCMAS corrects the covered prefix.
    whole_coverage: ClassVar[bool] = False
    # KVComm's code: a key correction is kept post-RoPE at the positions its anchor was observed
    # at, and added to a target at other positions without re-rotation (an error of the position
    # difference); kvbench's own rule keeps it canonical and rotates it to the target.
    unrotated_deltas: ClassVar[bool] = False

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        self.pools: dict[str, AnchorPool] = {}
        self.references = ContextFreeReferences(self.reference_prefix)  # non-chained methods' sources
        self.memo = MatchMemo()  # distances of sources to anchor bases, by source segment
        self.prematches: list[Prematch] = []
        self.pending: list[PendingAnchor] = []  # each waits until its request is computed
        self.open = OpenDecisions()
        self.peak_bytes: dict[str, int] = {}
        self.exchange: AnchorExchange | None = None  # the pools shared with other instances, where there are some

    def bind(self, core: CoreServices) -> None:
        super().bind(core)
        state = core.shared_state("anchors")
        self.exchange = None if state is None else AnchorExchange.over(state)

    def _sharing(self) -> AnchorExchange | None:
        return self.exchange if self.params.get("anchor_sharing", "tier") == "tier" else None

    # -------------------------------------------------------------- sources
    def _reads_producer(self, segment: PlanSegment) -> bool:
        """The segment is corrected from the cache of the turn that holds it (its source), not from
        a context-free reference: always when chained; an agent's output under kvcomm-ref."""
        return self.chained or (self.outputs_from_producer and segment.id.startswith(OUTPUT_SEGMENT_PREFIX))

    def loads_request(self, plan: Plan) -> bool:
        # Non-chained: every shared segment is served from its context-free reference, a first
        # agent's too; chained: only segments a source holds.
        return super().loads_request(plan) or (not self.chained and any(s.kind == "ph" for s in plan.segments))

    def prepare(self, ctx: LoadContext) -> Generator[int, None, None]:
        """Non-chained: prefill the context-free references this load lacks, so that asynchronous
        loads spread an 8K reference prefill over engine steps (a load in one step runs it whole)."""
        if self.chained:
            return
        assert self.core is not None
        for segment in ctx.plan.segments:  # (segments read from their producer have no reference)
            span = self.references.span(ctx, segment, self._reads_producer(segment))
            if span is not None and span[2] not in self.references.entries:
                yield from self.references.prefill(self.core, ctx, *span)

    def _source_memo(self, reuse: SegmentReuse) -> SegmentDistances | None:
        """The memoized distances of a chained source's segment (prematched after its producer's
        first token), when this load reads it whole from its first row and it is still the cache
        they were taken from."""
        segment = reuse.segment
        n = len(reuse.dst)
        if (not self.params.get("prematch") or segment.source is None or segment.source_start is None or n == 0
                or int(reuse.dst[0]) != segment.start or int(reuse.dst[-1]) - int(reuse.dst[0]) != n - 1):
            return None
        key = (segment.source, segment.source_start, segment.id)
        entry = self.memo.get(key)
        if entry is not None and not entry.matches(reuse.source.v, segment.source_start):
            self.memo.drop(key)  # not the cache the distances were taken from
            return None
        return entry

    # -------------------------------------------------------------- the method
    def select(self, ctx: LoadContext) -> list[SegmentReuse]:
        by_segment = {c.segment.id: c for c in ctx.candidates}
        chosen, decisions, eligible = [], [], 0
        fallbacks = self.open.open(ctx.request_key)
        for segment in ctx.plan.segments:
            if segment.kind != "ph":
                continue
            memo: SegmentDistances | None = None
            from_producer = self._reads_producer(segment)
            if from_producer:
                reuse = by_segment.get(segment.id)
                if reuse is not None:
                    memo = self._source_memo(reuse)
            else:
                assert self.core is not None
                reuse, memo_key = self.references.reuse(self.core, ctx, segment, self._reads_producer(segment))
                if reuse is not None and self.matching:
                    memo = self.memo.get(memo_key)
                    if memo is None:
                        memo = SegmentDistances(rows=len(reuse.dst))
                        self.memo.put(memo_key, memo)
            if reuse is None:
                continue
            eligible += len(reuse.dst)
            started = time.perf_counter()
            source = segment.source_agent if from_producer else "ref"
            edge = f"{source}->{ctx.plan.agent}"
            rows = LazyRows(lambda reuse=reuse: canonical_source_rows(self.core.aligner, reuse, exact=False))
            decision = self._decide(segment.id, edge, len(reuse.dst), rows, memo)
            decision.update(id=segment.id, rows_s=rows.seconds)
            observe = decision.pop("observe", True)  # a dense segment's rows teach the method
            if decision.pop("accept"):
                correction_k, correction_v = decision.pop("correction")
                self.open.accept(ctx.request_key, AcceptedCorrection(correction_k, correction_v, segment.start,
                                                                    segment.id, reuse))
                chosen.append(reuse)
            elif observe:
                fallbacks.append(Fallback(segment, reuse, edge))
            decision["decide_s"] = time.perf_counter() - started
            decisions.append(decision)
        if self.whole_agent_fallback and fallbacks and chosen:
            chosen = self._send_agent_dense(chosen, decisions)
        ctx.stats["eligible_tokens"] = eligible
        if not self.chained and not self.outputs_from_producer:
            ctx.stats["source_missing_tokens"] = 0  # corrects references only: the store's cap costs it nothing
        ctx.stats["decisions"] = decisions
        return chosen

    def _send_agent_dense(self, chosen: list[SegmentReuse], decisions: list[dict[str, Any]]) -> list[SegmentReuse]:
        """KVComm's mode per agent: one segment the gate rejected sends the whole agent to dense
        prefill. The segments it accepted are computed too, and (as in KVComm, where only flagged
        contents become anchors) not observed."""
        accepted = {reuse.segment.id for reuse in chosen}
        for decision in decisions:
            if decision.get("id") in accepted and decision.get("decision") == "accepted":
                decision["decision"] = "dense_agent"
        for reuse in chosen:
            self.open.withdraw(reuse)
        return []

    def threshold(self) -> float:
        return float(self.params[self.threshold_name])

    def _decide(self, slot: str, edge: str, n: int, rows: Callable[[], Rows],
                memo: SegmentDistances | None) -> dict[str, Any]:
        """Accept (with the correction) or reject one segment of n source rows for this edge."""
        capacity = int(self.params.get("V", 1))
        pool = self.pools.setdefault(slot, AnchorPool(capacity))
        if (exchange := self._sharing()) is not None:  # the other instances' anchors of the slot first
            exchange.pull_safely(slot, pool)
        compatible = pool.compatible(edge, min_length=1)
        gate_mode = self.params.get("gate", "entropy")
        if gate_mode == "dense":
            return {"accept": False, "decision": "dense_forced", "anchors": len(compatible)}
        # The gate needs two anchors; a pool of one (V = 1) bypasses it and applies its sole
        # anchor (the paper's appendix on V). The correction covers the longest prefix that
        # enough anchors hold: all n rows where they cover the segment, else the prefix the
        # second-longest anchor covers (the longest one the gate can compare), its rows past it
        # keeping the re-aligned source cache rather than an extrapolated correction (the
        # paper's "corrects the longest covered prefix").
        needed = 1 if capacity == 1 else 2
        coverage = sorted((a.covers(edge) for a in compatible), reverse=True)
        if len(coverage) < needed:
            return {"accept": False, "decision": "dense_few_anchors", "anchors": len(coverage)}
        if self.whole_coverage and coverage[needed - 1] < n:
            # KVComm's code: only anchors at least as long as the placeholder are candidates; with
            # fewer than two of them the placeholder is a new anchor (dense), never a prefix.
            return {"accept": False, "decision": "dense_uncovered", "anchors": len(coverage)}
        covered = min(n, coverage[needed - 1])
        eligible = [a for a in compatible if a.covers(edge) >= covered]
        if capacity == 1:
            (anchor,) = eligible
            anchor.uses += 1
            return {"accept": True, "decision": "accepted", "anchors": 1, "covered": covered,
                    "correction": (Correction([anchor.deltas[edge][0]], None, covered),
                                   Correction([anchor.deltas[edge][1]], None, covered))}
        k = min(covered, int(self.params.get("gate_tokens") or covered))  # the gate's first k rows
        # One pass over the value states serves the gate (Eq. 9, first k rows) and, on accept,
        # the token-wise value weights (all covered rows).
        started = time.perf_counter()
        value_distances, value_rows, kept = memoized_distances(eligible, covered, rows, memo, keys=False)
        value_squares = value_rows[:, :k].sum(dim=-1)
        assert self.core is not None
        ranks = self.core.tensor_parallel_size
        if ranks > 1:  # each rank holds some heads: the gate and weights are over all of them
            summed = self.core.sum_over_ranks(torch.cat((value_distances.flatten(), value_squares)))
            value_distances, value_squares = summed[:value_distances.numel()].view_as(value_distances), \
                summed[value_distances.numel():]
        gate = gate_from_distances(value_squares, self.threshold())
        gate_s = time.perf_counter() - started
        if not gate.accept and gate_mode != "accept":
            return {"accept": False, "decision": "dense_gate", "entropy": gate.normalized_entropy,
                    "anchors": len(eligible), "gate_s": gate_s, "memo_anchors": kept}
        key_distances, _, kept_keys = memoized_distances(eligible, covered, rows, memo, keys=True)
        if ranks > 1:
            key_distances = self.core.sum_over_ranks(key_distances)
        features = eligible[0].base_v.shape[-1] * ranks  # each rank holds some heads: the mean is over all
        correction = token_weighted_corrections(eligible, edge, covered, key_distances, value_distances, features)
        interpolate_s = time.perf_counter() - started - gate_s
        order = torch.argsort(gate.weights, descending=True)
        mass = 0.0
        for index in order.tolist():  # count a use for the anchors holding 90% of the gate mass
            eligible[index].uses += 1
            mass += float(gate.weights[index])
            if mass >= 0.9:
                break
        return {"accept": True, "decision": "accepted", "entropy": gate.normalized_entropy, "anchors": len(eligible),
                "covered": covered, "correction": correction, "gate_s": gate_s,
                "interpolate_s": interpolate_s, "memo_anchors": min(kept, kept_keys)}

    def correct(self, layer: int, reuse: SegmentReuse, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.open.correction(reuse)
        if (entry is None or (layer == 0 and not self.correct_layer0)
                or not self.params.get("apply_corrections", True)):
            return keys, values
        started = time.perf_counter()
        heads, head_dim = keys.shape[1], keys.shape[2]
        assert self.core is not None
        aligner, start = self.core.aligner, entry.segment_start

        def to_target(rows: torch.Tensor, exact: bool) -> torch.Tensor:
            """Rows [m, D] in canonical positions turned to the segment's target positions."""
            return aligner.rotate(rows.reshape(len(rows), heads, head_dim), start, exact=exact).reshape(len(rows), -1)

        # keys/values are the caller's fresh copies (SharingMethod.correct): added in place.
        keys, values = keys.contiguous(), values.contiguous()
        entry.k.add_to(layer, keys.view(len(keys), -1), None if self.unrotated_deltas else to_target)
        entry.v.add_to(layer, values.view(len(values), -1))
        entry.apply_s += time.perf_counter() - started
        return keys, values

    def after_load(self, ctx: LoadContext) -> None:
        entries, fallbacks = self.open.close(ctx.request_key)
        applied = {entry.segment_id: entry.apply_s for entry in entries}
        for decision in ctx.stats.get("decisions", []):  # correction time spent inside the load's layers
            if decision.get("id") in applied:
                decision["apply_s"] = applied[decision["id"]]
        if self.params.get("prematch") and self.chained and self.matching and ctx.plan.saved_key:
            for segment in ctx.plan.segments:  # this request's rows are a later edge's source
                stop = min(segment.start + segment.length, len(ctx.tokens))
                if segment.kind == "ph" and stop > segment.start:
                    rows = torch.arange(segment.start, stop)
                    self.prematches.append(Prematch(ctx.req_id, (ctx.plan.saved_key, segment.start, segment.id),
                                                    segment.id, segment.start, ctx.final_rows(rows)))
        for fallback in fallbacks:
            # The segment was computed densely (by the load, or by vLLM after the claim): its exact
            # cache against the (aligned) source gives the correction this edge needed. Only the
            # target rows are read, once computed (their blocks belong to this request); rotations
            # and factorization wait for run_deferred, after the first token.
            # One anchor per observation of a slot's content from one source (trajectory, source
            # agent, content): a base is only paired with corrections from the same source, and
            # the edges leaving that source share it (fan-out). The content key keeps a stale
            # anchor of another run's trajectory with the same id apart.
            segment = fallback.segment
            content = content_key(ctx.tokens[segment.start: segment.start + segment.length])
            anchor_id = f"{ctx.plan.trajectory}/{edge_source(fallback.edge)}/{content}"
            self.pending.append(PendingAnchor(ctx.req_id, segment.id, anchor_id, fallback.edge, fallback.reuse,
                                              ctx.final_rows(fallback.reuse.dst)))

    def run_deferred(self) -> None:
        rank_base = int(self.params["r_c"]) if self.low_rank else None
        rank_delta = int(self.params["r_delta"]) if self.low_rank else None
        # Work of a request vLLM has not computed yet waits: it would land in that request's TTFT.
        jobs, self.pending = self._ready(self.pending)
        prematches, self.prematches = self._ready(self.prematches)
        for job in jobs:
            rows = job.target()
            if rows is None:  # the request ended before its prompt was computed: nothing observed
                continue
            job.target_k, job.target_v = rows
            self._observe(job, rank_base, rank_delta)
        for prematch in prematches:  # after the new anchors: they are matched too
            try:
                self._prematch(prematch)
            except Exception:  # its readers then match at load, as without prematch
                logger.exception("kvbench: prematch of %s failed", prematch.key)
        self._track_peak()

    def _observed_rows(self, job: PendingAnchor) -> tuple[Rows, Rows]:
        assert self.core is not None
        return observed_rows(self.core.aligner, job)

    def _observe(self, job: PendingAnchor, rank_base: int | None, rank_delta: int | None) -> None:
        """A dense fallback becomes an anchor of its slot: the source's cache and the correction."""
        (source_k, source_v), (target_k, target_v) = self._observed_rows(job)
        pool = self.pools.setdefault(job.slot, AnchorPool(int(self.params.get("V", 1))))
        codec = self.params.get("base_codec", "none")
        base_codec = BaseCodec(make_codec(codec), job.target_v.shape[-1]) if codec != "none" else None
        delta_k = target_k - source_k
        if self.unrotated_deltas:  # kept where the anchor was observed: at the target's own positions
            assert self.core is not None
            layers, rows, width = delta_k.shape
            head_dim = job.target_k.shape[-1]
            delta_k = self.core.aligner.rotate(delta_k.view(layers, rows, width // head_dim, head_dim),
                                               job.source.segment.start).reshape(layers, rows, width)
        pool.add(job.anchor_id, job.edge, source_k, source_v, delta_k, target_v - source_v,
                 rank_base, rank_delta, torch.bfloat16, base_codec)
        if (exchange := self._sharing()) is not None:
            exchange.publish_safely(job.slot, pool, job.anchor_id)

    def shared_report(self) -> dict[str, Any]:
        return {} if self.exchange is None else {"shared_state": self.exchange.state.report()}

    def _ready(self, items: list[Any]) -> tuple[list[Any], list[Any]]:
        """(items whose request vLLM has computed, items still waiting for theirs), order kept."""
        ready: list[Any] = []
        waiting: list[Any] = []
        for item in items:
            (ready if self.core is None or self.core.computed(item.req_id) else waiting).append(item)
        return ready, waiting

    def _prematch(self, job: Prematch) -> None:
        """Distances of a saved request's segment to every anchor of its slot, keys and values,
        as the edge reading it would compute them (same rows, same rotation)."""
        pool = self.pools.get(job.slot)
        if pool is None or len(pool.anchors) < 2:
            return  # nothing to match yet: a later edge computes what it needs
        assert self.core is not None
        rows = job.read()  # [layers, n, H, hd], as computed
        if rows is None:
            return
        k, v = rows
        current = (flat(self.core.aligner.rotate(k, -job.start, exact=False)), flat(v))
        n = current[1].shape[1]
        entry = SegmentDistances(rows=n, check=current[1].index_select(
            1, SegmentDistances.check_rows(n).to(current[1].device)).clone())
        by_length: dict[int, list[Anchor]] = {}
        for anchor in pool.anchors.values():
            by_length.setdefault(min(n, anchor.length), []).append(anchor)
        for length, anchors in by_length.items():
            memoized_distances(anchors, length, lambda: current, entry, keys=False)
            memoized_distances(anchors, length, lambda: current, entry, keys=True)
        self.memo.put(job.key, entry)

    # -------------------------------------------------------------- accounting
    def state_bytes(self) -> dict[str, int]:
        current = self._current_bytes()
        self._track_peak(current)
        return {**current, **{f"peak_{k}": v for k, v in self.peak_bytes.items()}}

    def _current_bytes(self) -> dict[str, int]:
        return {"anchor_pool": sum(p.nbytes for p in self.pools.values()),
                "references": self.references.nbytes,
                "match_memo": self.memo.nbytes}

    def _track_peak(self, current: dict[str, int] | None = None) -> None:
        for key, value in (current or self._current_bytes()).items():
            self.peak_bytes[key] = max(self.peak_bytes.get(key, 0), value)

    def restart_peaks(self) -> None:
        self.peak_bytes = dict(self._current_bytes())

    def reset(self) -> None:
        if self.exchange is not None:
            self.exchange.forget()
        self.pools.clear()
        self.references.entries.clear()
        self.pending.clear()
        self.memo.clear()
        self.prematches.clear()
        self.open.clear()
        self.peak_bytes.clear()
