"""Views of a worker for the worker RPCs: what it runs, its stats, and read-only views of the
segment store for tests and analyses."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from kvbench import __version__
from kvbench.contracts import CONTRACT_VERSION, FidelityRequest, LayerFidelity, SegmentFidelity, ServerInfo, WorkerStats
from kvbench.methods.core.store import SegmentStore


def server_info(worker: Any) -> ServerInfo:
    """What a worker (kvbench.methods.connector.worker.ConnectorWorker) runs."""
    tier = worker.settings.shared_tier
    return ServerInfo(method=worker.method.name, params=dict(worker.method.params),
                      model_attached=worker.forward is not None, kvbench_version=__version__,
                      shared_tier=tier.to_dict() if tier is not None else None)


def worker_stats(worker: Any, clear: bool) -> WorkerStats:
    """A worker's per-request method stats and its store's and method's state (`clear`: the
    per-request stats start over)."""
    store = worker.store
    out = WorkerStats(
        method=worker.method.name, params=dict(worker.method.params), requests=dict(worker.request_stats),
        store_bytes=store.bytes, store_peak_bytes=store.peak_bytes, store_entries=len(store.entries),
        store_evictions=store.evictions, store_refused=store.refused, method_state_bytes=worker.method.state_bytes(),
        model_attached=worker.forward is not None,
        extra={"deferred_s": worker.deferred_s, **store.report(), **worker.method.shared_report()})
    if clear:
        worker.request_stats.clear()
    return out


def kv_error(store: SegmentStore, key: str, reference: str, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    """Normalized error ||C - C_ref||_F / ||C_ref||_F per layer over rows [start, stop)."""
    entry, ref = store.get(key), store.get(reference)
    if entry is None or ref is None:
        raise KeyError(f"not in the segment store: {key if entry is None else reference}")
    n = min(entry.num_tokens, ref.num_tokens, stop if stop is not None else 1 << 62)
    layers = []
    rows = slice(start, n)
    for layer in range(entry.k.shape[0]):
        row = {}
        for name, a, b in (("k", entry.k[layer, rows], ref.k[layer, rows]),
                           ("v", entry.v[layer, rows], ref.v[layer, rows])):
            expected = b.float()
            diff = a.float() - expected
            # this rank's share of the squared norms (tensor-parallel ranks' shards add up), and
            # the relative error they give
            sq_err, sq_ref = float(diff.square().sum()), float(expected.square().sum())
            row[f"{name}_sq_err"], row[f"{name}_sq_ref"] = sq_err, sq_ref
            row[f"{name}_rel"] = math.sqrt(sq_err) / max(math.sqrt(sq_ref), 1e-30)
            row[f"{name}_max_abs"] = float(diff.abs().max())
        layers.append(row)
    identical = bool(torch.equal(entry.k[:, rows], ref.k[:, rows]) and torch.equal(entry.v[:, rows], ref.v[:, rows]))
    return {"rows": n - start, "layers": layers, "bit_identical": identical,
            "same_tokens": bool(torch.equal(entry.token_ids[rows], ref.token_ids[rows]))}


def saved_rows(store: SegmentStore, key: str, layer: int, start: int, stop: int) -> dict[str, Any]:
    """K and V rows [start, stop) of one layer of a saved cache."""
    entry = store.get(key)
    if entry is None:
        raise KeyError(f"not in the segment store: {key}")
    return {"k": entry.k[layer, start:stop].float().tolist(), "v": entry.v[layer, start:stop].float().tolist()}


def _top_share(scores: torch.Tensor, weights: torch.Tensor, k: int) -> float:
    """Share of `weights`' total held by the `k` rows of highest score."""
    total = float(weights.sum())
    if k <= 0 or total <= 0:
        return 0.0
    return float(weights[torch.topk(scores.float(), min(k, len(scores))).indices].sum()) / total


def fidelity_measures(target_k: torch.Tensor, target_v: torch.Tensor, reused_k: torch.Tensor, reused_v: torch.Tensor,
                      check_layer: int, recompute_tokens: int, attention: torch.Tensor | None = None,
                      sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> SegmentFidelity:
    """One segment's dense target rows against the rows reuse would serve ([layers, n, heads, hd]
    each, keys re-aligned): per layer the singular values of the reused rows (the base a delta
    method matches on) and of the correction target - reused, and the reuse error; and how much of
    the reuse error two token criteria would remove by recomputing `recompute_tokens` tokens in
    every layer: the largest value deviation at `check_layer` (CacheBlend's) and the most attention
    received (`attention` [n], RelayCaching's). Error energy of (layer, token) =
    ||dK||^2 / ||K_layer||^2 + ||dV||^2 / ||V_layer||^2, so every layer's keys and values weigh by
    their own scale; with tensor parallelism the norms and the criteria are summed over ranks, the
    spectra are of this rank's heads."""
    layers: list[LayerFidelity] = []
    token_error = torch.zeros(target_k.shape[1], dtype=torch.float64)
    deviation = torch.zeros(target_k.shape[1], dtype=torch.float64)
    per_layer = []
    for layer in range(target_k.shape[0]):
        row: dict[str, Any] = {}
        energies = []
        for name, target, reused in (("k", target_k[layer], reused_k[layer]), ("v", target_v[layer], reused_v[layer])):
            t, r = target.flatten(1).float(), reused.flatten(1).float()
            delta = t - r
            row[f"{name}_base_sv"] = torch.linalg.svdvals(r).tolist()
            row[f"{name}_delta_sv"] = torch.linalg.svdvals(delta).tolist()
            sq_token = delta.double().square().sum(1)  # [n], this rank's heads
            row[f"{name}_sq_err"], row[f"{name}_sq_ref"] = float(sq_token.sum()), float(t.double().square().sum())
            ranks = sum_over_ranks(torch.stack((sq_token, t.double().square().sum(1))))  # [2, n] over all heads
            energies.append(ranks[0] / max(float(ranks[1].sum()), 1e-30))
            if name == "v" and layer == check_layer:
                deviation = ranks[0]
        layer_tokens = energies[0] + energies[1]
        token_error += layer_tokens.cpu()
        per_layer.append(float(layer_tokens.sum()))
        layers.append(cast(LayerFidelity, row))
    deviation = deviation.cpu()
    return {"layers": layers, "layer_error": per_layer, "tokens": int(target_k.shape[1]),
            "feature_dim": int(target_k.shape[2] * target_k.shape[3]),
            "recompute_tokens": int(recompute_tokens),
            "deviation_removed": _top_share(deviation, token_error, recompute_tokens),
            "attention_removed": (_top_share(attention.cpu(), token_error, recompute_tokens)
                                  if attention is not None else float("nan")),
            "contract_version": CONTRACT_VERSION}


def segment_fidelity(worker: Any, request: FidelityRequest) -> SegmentFidelity:
    """`fidelity_measures` of a request's segment, both caches prefilled densely here by the
    model served (the connector's partial forward, context-free: a whole prompt from position 0)."""
    from kvbench.methods.core.forward import run_to_end
    from kvbench.methods.core.influence import attention_mass

    if worker.forward is None:
        raise RuntimeError("model not attached (call kvbench_attach_model first)")
    device = next(iter(worker.kv_caches.values())).device
    target = torch.tensor(request.target_tokens, dtype=torch.long, device=device)
    source = torch.tensor(request.source_tokens, dtype=torch.long, device=device)
    num_layers = len(worker.forward.layers)
    if not 0 <= request.check_layer < num_layers:
        raise ValueError(f"check layer {request.check_layer} is not a layer of this {num_layers}-layer model")
    queries: list[torch.Tensor] = []
    tail = min(request.query_tail, len(target))
    target_k, target_v = run_to_end(worker.forward.context_free_steps(target, queries, tail))
    source_k, source_v = run_to_end(worker.forward.context_free_steps(source))
    rows = slice(request.target_start, request.target_start + request.length)
    source_rows = slice(request.source_start, request.source_start + request.length)
    reused_k = worker.aligner.rotate(source_k[:, source_rows], request.target_start - request.source_start)
    attention = None
    if tail:
        layer = request.check_layer
        positions = torch.arange(len(target) - tail, len(target), device=device)
        scale = worker.forward.layers[layer].self_attn.attn.impl.scale
        attention = worker.sum_over_ranks(attention_mass(queries[layer], positions, target_k[layer], scale))[rows]
    return fidelity_measures(target_k[:, rows], target_v[:, rows], reused_k, source_v[:, source_rows],
                             request.check_layer, request.recompute_tokens, attention, worker.sum_over_ranks)
