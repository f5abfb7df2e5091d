"""Materializing one request's cache: which rows are reused, where they are placed, which are
computed, and how they are counted.

Rows a method reuses come from a saved source cache, keys re-rotated to their new positions,
plus the method's correction; every other claimed row is computed by a partial forward over the
model's own modules. Selective recomputation (a check layer) and layer groups change which rows
are computed in which layers; `count_rows` turns that into whole-token reused/recomputed counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

from kvbench.contracts import LoadStats
from kvbench.methods.api.base import CoreServices, LoadContext, SegmentReuse, SharingMethod
from kvbench.methods.connector.compute_tracker import ComputedRequests
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.connector.specs import DecideSpec, LoadSpec
from kvbench.methods.core.forward import LayerGroup, PartialForward
from kvbench.methods.core.store import SavedKV, SegmentStore


class LoadServices(CoreServices, Protocol):
    """What one load needs of the worker side (kvbench.methods.connector.worker.ConnectorWorker)."""

    settings: ConnectorSettings
    method: SharingMethod
    block_size: int
    store: SegmentStore
    forward: PartialForward
    kv_caches: dict[str, torch.Tensor]
    layouts: dict[str, Any]  # layer name -> its kvbench.methods.core.paged layout
    computed_requests: ComputedRequests

    def tensor_parallel_rank(self) -> int: ...

    def hidden_layer(self) -> int | None:
        """The layer whose entering residual stream the method recomputes from (None: none kept)."""

    def note_exact_rows(self, key: str, rows: int) -> None:
        """The request saved as `key` holds dense-prefill K/V in its first `rows` rows."""

    def when_prefilled(self, req_id: str, rows: torch.Tensor, deliver: Callable[[torch.Tensor, torch.Tensor], None],
                       key: str | None = None) -> None:
        """deliver(K, V) of the request's rows once its prompt is computed."""

    def rows_reader(self, block_ids: torch.Tensor) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Reads K, V [layers, rows, Hkv, hd] of a request's rows from the paged cache."""

    def influence(self, layer: int, q: torch.Tensor, q_rows: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Attention mass each row receives at `layer` from the query rows (summed over heads)."""


@dataclass
class Candidates:
    """PH rows a saved source holds with identical tokens, and the PH rows without one."""

    reuses: list[SegmentReuse] = field(default_factory=list)
    missing: int = 0  # PH rows no source holds (no source named, evicted, or other tokens)
    evicted: int = 0  # among them: rows whose named source the store no longer holds (evicted or refused)
    refused: int = 0  # among those: rows whose source was larger than the store's whole cap


def find_candidates(store: SegmentStore, spec: LoadSpec | DecideSpec, tokens: torch.Tensor) -> Candidates:
    """Match each PH segment of the plan with its source's rows; never reuse rows of other tokens."""
    found = Candidates()
    for segment in spec.plan.segments:
        if segment.kind != "ph":
            continue
        start = max(segment.start, spec.num_local)
        stop = min(segment.start + segment.length, spec.num_target)
        if stop <= start:
            continue
        source = store.get(segment.source, segment.source_adapter) if segment.source else None
        if source is None or segment.source_start is None:
            found.missing += stop - start
            if segment.source and source is None:  # the store's cap dropped (or refused) it
                found.evicted += stop - start
                if store.was_refused(segment.source):
                    found.refused += stop - start
            continue
        dst = torch.arange(start, stop)
        src = dst - segment.start + segment.source_start
        inside = src < source.num_tokens  # the producer's last token never got K/V
        dst, src = dst[inside], src[inside]
        same = source.token_ids[src] == tokens[dst]
        found.missing += (stop - start) - int(same.sum())
        if bool(same.any()):
            found.reuses.append(SegmentReuse(segment, source, dst[same], src[same]))
    return found


def exact_prefix(store: SegmentStore, spec: LoadSpec | DecideSpec, tokens: torch.Tensor,
                 block_size: int) -> tuple[SavedKV | None, int]:
    """The cache named in the plan (Plan.exact_sources) holding the longest run of this
    request's first rows with the same tokens at the same positions inside its exact rows
    (SavedKV.exact_rows), and where that run ends, in whole blocks (as vLLM's prefix cache serves
    them); (None, 0) where none does. Such rows are what a dense prefill computes: copied, not
    reused (an agent's next round reads its own earlier prompt this way, which its cache_salt
    keeps vLLM's prefix cache from serving)."""
    best: tuple[SavedKV | None, int] = (None, 0)
    for key in sorted(spec.plan.exact_sources):  # sorted: every tensor-parallel rank picks alike
        source = store.exact_entry(key, spec.plan.adapter)
        if source is None:
            continue
        n = min(len(tokens), source.exact_rows)
        differs = (source.token_ids[:n] != tokens[:n]).nonzero()
        common = int(differs[0]) if len(differs) else n
        common -= common % block_size
        if common > best[1]:
            best = (source, common)
    return best


def copy_exact_rows(worker: LoadServices, source: SavedKV, start: int, stop: int, slots: torch.Tensor) -> None:
    """Rows [start, stop) of `source` into the request's blocks, every layer, as they are."""
    for index, name in enumerate(worker.forward.layer_names):
        worker.layouts[name].write(worker.kv_caches[name], slots[start:stop], source.k[index, start:stop],
                                   source.v[index, start:stop])


class Placement:
    """The reused rows' K/V per layer: the source's rows re-rotated and corrected by the method.
    At each check layer they are kept for the comparison with the fresh rows computed there."""

    def __init__(self, worker: LoadServices, method: SharingMethod, chosen: list[SegmentReuse],
                 check_layers: list[int], group_layers: tuple[int, int] | None, poison: bool) -> None:
        self.worker, self.method, self.chosen = worker, method, chosen
        self.check_layers, self.group_layers, self.poison = check_layers, group_layers, poison
        self.check = check_layers[0] if check_layers else None
        self.rows = torch.cat([r.dst for r in chosen]) if chosen else torch.empty(0, dtype=torch.long)
        self.at_check: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.seconds = 0.0  # building the placed rows, every layer: gathering, RoPE, correction, checks
        self.rope_seconds = 0.0  # of which re-rotating keys to their new positions
        # the largest |value| placed so far, on the cache's device: NaN or inf once any placed value
        # is not finite (max propagates both; a reduction to one value per layer costs an eighth of
        # counting the non-finite values: 0.95 against 7.4 ms for an 8K layer on one CPU core)
        self.largest: torch.Tensor | None = None

    def raise_if_nonfinite(self) -> None:
        """Summed over tensor-parallel ranks (each holds other heads), so that all of them raise
        together: a rank falling back alone would leave the others waiting in a collective."""
        if self.largest is None:
            return
        flagged = (~torch.isfinite(self.largest)).float().reshape(1)
        if float(self.worker.sum_over_ranks(flagged)) > 0:
            raise FloatingPointError(f"non-finite K/V placed by method {self.method.name}")

    def all_computed(self, layer: int) -> bool:
        """Every reused row is computed in this layer (so none is placed)."""
        if self.group_layers is None:
            return self.check is not None and layer < self.check
        start, stop = self.group_layers
        return start <= layer < (self.check if self.check is not None else stop)

    def __call__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.chosen or self.all_computed(layer):
            return self.rows[:0], torch.empty(0), torch.empty(0)
        started = time.perf_counter()
        ks, vs = [], []
        for reuse in self.chosen:
            src = reuse.src.to(reuse.source.k.device)  # plans index on the CPU; the cache may be on a GPU
            gathered = reuse.source.k[layer].index_select(0, src)
            rope_started = time.perf_counter()
            k = self.worker.aligner.rotate(gathered, reuse.dst - reuse.src)
            self.rope_seconds += time.perf_counter() - rope_started
            v = reuse.source.v[layer].index_select(0, src)
            k, v = self.method.correct(layer, reuse, k, v)
            ks.append(k)
            vs.append(v)
        k_all, v_all = torch.cat(ks), torch.cat(vs)
        if self.poison:
            k_all.view(-1)[0] = float("nan")
        # Reduced on the device and read once, after the last layer (`raise_if_nonfinite`): a
        # read per layer would stall a GPU's queue every layer. Rows placed before then are the
        # request's own and vLLM computes them again when the load falls back.
        if k_all.numel():
            largest = torch.maximum(k_all.abs().amax(), v_all.abs().amax())
            self.largest = largest if self.largest is None else torch.maximum(self.largest, largest)
        if layer in self.check_layers:  # written, then overwritten by the fresh rows: kept for the comparison
            self.at_check[layer] = (k_all, v_all)
        self.seconds += time.perf_counter() - started
        return self.rows, k_all, v_all


class Narrowing:
    """At each check layer: keep computing the rows no source held and the reused rows the method
    picks from their fresh vs reused K/V (and the attention they get), among those still computed."""

    def __init__(self, worker: LoadServices, ctx: LoadContext, placement: Placement, reused: torch.Tensor,
                 block_ids: torch.Tensor) -> None:
        self.worker, self.ctx, self.placement = worker, ctx, placement
        self.reused, self.block_ids = reused, block_ids
        # Reused rows still computed (placement order); rows vLLM's prefix cache held never are.
        self.active = placement.rows >= ctx.num_local
        self.stages: list[tuple[int, int]] = []  # (check layer, reused rows kept computing after it)

    @property
    def picked(self) -> int:
        """Reused rows computed through the last layer."""
        return self.stages[-1][1] if self.stages else 0

    def __call__(self, layer: int, computed: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor | None:
        if layer not in self.placement.check_layers:
            return None
        k_reused, v_reused = self.placement.at_check.pop(layer)
        rows = self.placement.rows[self.active]
        position = torch.searchsorted(computed, rows)  # computed rows are in position order
        method, influence = self.worker.method, None
        if (queries := method.influence_queries()) > 0:
            influence = self.worker.influence(layer, q[-queries:], computed[-queries:], self.block_ids)[rows]
        chosen_rows = method.recompute(self.ctx, layer, k[position], v[position], k_reused[self.active],
                                       v_reused[self.active], influence).cpu()  # row indices live on the CPU
        keep = ~self.reused[computed]
        keep[position[chosen_rows]] = True
        self.active[self.active.nonzero().flatten()[~chosen_rows]] = False
        self.stages.append((layer, int(chosen_rows.sum())))
        return keep.nonzero().flatten()


def count_rows(reused: torch.Tensor, compute: torch.Tensor, stages: Sequence[tuple[int, int]], check: int | None,
               group_layers: tuple[int, int] | None, layers: int) -> tuple[int, int]:
    """(reused, recomputed) rows in whole-token units. Selective recomputation: reused rows count
    as reused when served from reuse after the (last) check layer; the ones computed through the
    last layer count as recomputed. A recomputed layer group: reused rows count by the share of
    their (token, layer) entries served from reuse."""
    reused_count, picked = int(reused.sum()), (stages[-1][1] if stages else 0)
    if group_layers is None:
        recomputed = (int((~reused[compute]).sum()) + picked) if check is not None else int(len(compute))
        return reused_count - picked, recomputed
    served = round(served_entries(reused_count, stages, check, group_layers, layers) / layers)
    return served, int(len(compute)) + reused_count - served


def served_entries(reused_count: int, stages: Sequence[tuple[int, int]], check: int | None,
                   group_layers: tuple[int, int] | None, layers: int) -> int:
    """(token, layer) entries of the reused rows served from reuse, not computed: a check layer's
    rows compute every layer up to it (CacheBlend: from layer 0), a layer group's rows compute its
    layers, and the rows kept at each check layer (`stages`: (layer, rows kept), ascending)
    compute the layers up to the next one, the last ones the rest of the group (or of the model)."""
    if check is None and group_layers is None:
        return reused_count * layers
    start, stop = group_layers if group_layers is not None else (0, layers)
    all_width = (check + 1 - start) if check is not None else (stop - start)  # layers every reused row computes
    ends = [layer for layer, _ in stages[1:]] + [stop - 1]
    computed_after = sum(kept * (end - layer) for (layer, kept), end in zip(stages, ends))
    return reused_count * layers - reused_count * all_width - computed_after


def _rows_not_loaded(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("this request's rows are computed by vLLM's own prefill, not by a load: read them with "
                       "core.when_prefilled once its prompt is computed")


@dataclass
class LoadDecision:
    """What a load reuses, decided before its rows are materialized: the exact prefix it copies,
    the candidates and the method's choice among them. Made inside the load, or one engine step
    ahead of the claim (SharingMethod.decides_before_claim), when it also sets how far the claim
    reaches (`claim_stop`)."""

    num_local: int  # the local hit it was decided above (a load above another one decides again)
    exact_source: SavedKV | None
    exact_stop: int
    found: Candidates
    ctx: LoadContext
    chosen: list[SegmentReuse]
    decoded_s: float = 0.0  # decoding compressed sources (PolyKV) for it
    decoded_tokens: int = 0
    seconds: float = 0.0

    def claim_stop(self, row_cost: float) -> int:
        """The rows [0, stop) the connector materializes; vLLM prefills every row after it in its
        own forward. The stop is where a reused segment ends (or the exact prefix, when nothing
        is worth reusing), whichever costs least in prefilled rows, a row the connector computes
        (glue text, a segment sent dense between reused ones) counting `row_cost` rows of vLLM's
        prefill: a large segment sent dense before a few reused rows goes to vLLM with them,
        rather than through the connector's slower layer-by-layer forward. Reused segments past
        the stop are dropped from `chosen` (computed densely) and marked in the decisions."""
        base, n = self.ctx.num_local, len(self.ctx.tokens)
        best, best_cost = base, float(n - base)
        for stop in sorted({int(r.dst.max()) + 1 for r in self.chosen if len(r.dst)}):
            reused = sum(int((r.dst < stop).sum()) for r in self.chosen)
            cost = row_cost * (stop - base - reused) + (n - stop)
            if cost < best_cost:
                best, best_cost = stop, cost
        dropped = {r.segment.id for r in self.chosen if len(r.dst) and int(r.dst.max()) >= best}
        self.chosen = [r for r in self.chosen if len(r.dst) and int(r.dst.max()) < best]
        for decision in self.ctx.stats.get("decisions", []):
            if decision.get("id") in dropped:
                decision["prefilled_by_vllm"] = True  # accepted, but past the claim
        return max(best, self.exact_stop)


def decide_steps(worker: LoadServices, spec: LoadSpec | DecideSpec, tokens: torch.Tensor,
                 read_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = _rows_not_loaded
                 ) -> Generator[int, None, LoadDecision]:
    """The decision of a load over the rows `tokens` (the prompt but its last token): the exact
    prefix, the candidates, the method's `prepare` (yields its rows per layer) and `select`."""
    started = time.perf_counter()
    store = worker.store
    decoded_s, decoded_tokens, fetched = store.decode_s, store.decoded_tokens, (store.fetched, store.fetched_bytes, store.fetch_s)
    exact_source, exact_stop = exact_prefix(store, spec, tokens, worker.block_size)
    valid_from = max(spec.num_local, exact_stop) if exact_source is not None else spec.num_local
    found = find_candidates(store, dataclasses.replace(spec, num_local=valid_from), tokens)
    decoded_s, decoded_tokens = store.decode_s - decoded_s, store.decoded_tokens - decoded_tokens
    # sources read from the shared tier (saved on another instance): how many, their bytes, get and parse
    fetch_stats = {"shared_fetches": store.fetched - fetched[0], "shared_fetch_bytes": store.fetched_bytes - fetched[1],
                   "shared_fetch_s": store.fetch_s - fetched[2]} if store.fetch_s > fetched[2] else {}
    req_id, key = spec.req_id, spec.key
    ctx = LoadContext(spec.key, spec.plan, tokens, valid_from, found.reuses, read_rows, req_id=req_id,
                      when_prefilled=lambda rows, deliver: worker.when_prefilled(req_id, rows, deliver, key))
    ctx.stats.update(fetch_stats)
    yield from worker.method.prepare(ctx)  # e.g. reference prefills: spread over steps like the layers
    chosen = worker.method.select(ctx)
    return LoadDecision(spec.num_local, exact_source, exact_stop if exact_source is not None else 0, found, ctx,
                        chosen, decoded_s, decoded_tokens, time.perf_counter() - started)


def prompt_rows(spec: LoadSpec | DecideSpec) -> torch.Tensor:
    """The ids of the rows a load could materialize: the prompt but its last token."""
    ids = spec.token_ids if isinstance(spec, DecideSpec) else spec.token_ids[:-1]
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def materialize_steps(worker: LoadServices, spec: LoadSpec,
                      keep_hidden: Callable[[str, tuple[torch.Tensor, torch.Tensor, int]], None],
                      decision: LoadDecision | None = None) -> Generator[int, None, LoadStats]:
    """A request's load, one partial-forward layer at a time (yields the rows each computed).
    `decision`: made one step ahead (DecideSpec), used when it was made above this load's local hit."""
    if worker.settings.fails_load(spec.key, spec.plan.inject_fault):
        raise RuntimeError("injected fault (kv_connector_extra_config.fault_injection)")
    if worker.forward is None:
        raise RuntimeError("model not attached: call the worker extension's kvbench_attach_model "
                           "(kvbench serve/replay do this after start-up)")
    method, n = worker.method, spec.num_target
    tokens = torch.tensor(spec.token_ids[:n], dtype=torch.long)
    block_ids = torch.tensor(spec.block_ids, dtype=torch.long)
    positions = torch.arange(n, dtype=torch.long)
    slots = block_ids[positions // worker.block_size] * worker.block_size + positions % worker.block_size
    decided_ahead = decision is not None and decision.num_local == spec.num_local
    if decision is None or not decided_ahead:
        decision = yield from decide_steps(worker, spec, tokens)
    ctx, chosen, found = decision.ctx, decision.chosen, decision.found
    ctx.read_rows = worker.rows_reader(block_ids)  # the load's rows, valid once it ends
    exact_copied = 0
    if decision.exact_source is not None and min(decision.exact_stop, n) > spec.num_local:
        copy_exact_rows(worker, decision.exact_source, spec.num_local, min(decision.exact_stop, n), slots)
        exact_copied = min(decision.exact_stop, n) - spec.num_local
        spec = dataclasses.replace(spec, num_local=min(decision.exact_stop, n))  # valid from here on, like vLLM's own hits
    if any(len(reuse.dst) and int(reuse.dst.max()) >= n for reuse in chosen):
        raise RuntimeError(f"the decision reuses rows past the {n} rows claimed")  # vLLM computes it, densely
    decoded_s, decoded_tokens = decision.decoded_s, decision.decoded_tokens
    reused = torch.zeros(n, dtype=torch.bool)
    for reuse in chosen:
        reused[reuse.dst] = True
    reused[: spec.num_local] = False
    compute = (~reused).nonzero().flatten()
    compute = compute[compute >= spec.num_local]
    check_layers = method.check_layers() if chosen else []
    check = check_layers[0] if check_layers else None
    group_layers = method.recompute_layers() if chosen else None
    poison = (worker.settings.fault_injection == "flagged_nonfinite_rank0" and spec.plan.inject_fault
              and worker.tensor_parallel_rank() == 0)
    placement = Placement(worker, method, chosen, check_layers, group_layers, poison)
    group = None
    if group_layers is not None:  # reused rows are computed in these layers, from their source's stream
        start, stop = group_layers
        entering = None
        if start:
            entering = torch.cat([r.source.hidden[r.src.to(r.source.hidden.device)]  # type: ignore[index]
                                  for r in chosen])
        group = LayerGroup(placement.rows, entering, start, stop)
    if check is not None and group is None:  # CacheBlend: every row is computed up to the check layer
        compute = torch.arange(spec.num_local, n)
    narrowing = Narrowing(worker, ctx, placement, reused, block_ids) if check is not None else None
    capture = worker.hidden_layer() if spec.plan.saved_key else None

    started = time.perf_counter()
    forward = yield from worker.forward.steps(tokens, block_ids, slots, compute, placement, narrowing, group, capture,
                                              worker.adapter(spec.plan.adapter))
    placement.raise_if_nonfinite()
    if capture is not None and forward.captured is not None:
        keep_hidden(str(spec.plan.saved_key), (*forward.captured, capture))
    stages = narrowing.stages if narrowing else []
    reused_count, recomputed = count_rows(reused, compute, stages, check, group_layers, worker.num_layers)
    vllm_rows = max(0, len(spec.token_ids) - 1 - n)  # prefilled by vLLM after the claim (its last token aside)
    recomputed += vllm_rows
    if spec.plan.saved_key:  # rows before the first reused one are exact: later requests may copy them
        placed = reused.nonzero()
        worker.note_exact_rows(spec.plan.saved_key, int(placed[0]) if len(placed) else 1 << 62)
    stats: dict[str, Any] = {
        "method": method.name,
        "reused_tokens": reused_count,
        "recomputed_tokens": recomputed,
        "served_entries": served_entries(int(reused.sum()), stages, check, group_layers, worker.num_layers),
        "layers": worker.num_layers,
        "exact_prefix_tokens": exact_copied,
        "ph_without_source_tokens": found.missing,
        "source_missing_tokens": found.evicted,
        "source_refused_tokens": found.refused,
        "eligible_tokens": ctx.stats.pop("eligible_tokens", sum(len(c.dst) for c in found.reuses)),
        "materialize_s": time.perf_counter() - started,
        **({"decided_ahead_s": decision.seconds} if decided_ahead else {}),
        **({"vllm_prefilled_tokens": vllm_rows} if vllm_rows else {}),
        **({"store_decode_s": decoded_s, "store_decoded_tokens": decoded_tokens} if decoded_tokens else {}),
        "attention_s": forward.attention_s,
        "placement_s": placement.seconds,
        "rope_s": placement.rope_seconds,
        "segments": [{"id": r.segment.id, "source": r.segment.source, "reused": int(len(r.dst))} for r in chosen],
        **ctx.stats,
    }
    ctx.stats = stats  # after_load may add to them
    worker.computed_requests.loaded(spec.req_id)
    method.after_load(ctx)
    return cast(LoadStats, stats)
