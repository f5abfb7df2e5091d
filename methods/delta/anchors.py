"""Anchor pools for delta correction (KVComm, KVCMAS): the pool, the reliability gate and
token-wise interpolation (how bases and deltas are stored: `kvbench.methods.delta.stored`). Pure tensor
code, independent of vLLM.

Shapes: a cache of one segment is [layers, tokens, features] with features = KV heads x head dim;
keys are kept in canonical positions (the segment rotated as if it started at position 0).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbench.methods.delta.stored import BaseCodec, Coded, FullRank, LowRank, Stored, store, stored_dtype_device

EVICTION_WINDOW = 5  # LFU among the 5 oldest anchors (KVComm's policy, kept by KVCMAS)
_ANCHOR_SERIALS = itertools.count()  # identity of an anchor's base, for memoized distances


def edge_source(edge: str) -> str:
    """The source of a workflow edge "A0->A1" (a context-free reference: "ref")."""
    return edge.split("->", 1)[0]


@dataclass
class Anchor:
    """One observed content of a slot as one source held it: that source's cache (the base) and
    the corrections its consumers needed against it (Eq. 7: a base is only ever paired with
    corrections from the same source)."""

    anchor_id: str
    source: str
    base_k: Stored
    base_v: Stored
    deltas: dict[str, tuple[Stored, Stored]] = field(default_factory=dict)  # edge -> (dK, dV)
    uses: int = 0
    # Unique for the process's life (an evicted anchor's id may come back with another base):
    # distances to this base may be memoized under it.
    serial: int = field(default_factory=lambda: next(_ANCHOR_SERIALS))

    @property
    def length(self) -> int:
        return self.base_v.length

    def covers(self, edge: str) -> int:
        """Rows this anchor can compare and correct for an edge (its base and that correction)."""
        return min(self.length, self.deltas[edge][1].length) if edge in self.deltas else 0

    @property
    def nbytes(self) -> int:
        return self.base_k.nbytes + self.base_v.nbytes + sum(k.nbytes + v.nbytes for k, v in self.deltas.values())


class AnchorPool:
    """Up to `capacity` anchors of one shared slot, in insertion order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.anchors: OrderedDict[str, Anchor] = OrderedDict()

    def compatible(self, edge: str, min_length: int) -> list[Anchor]:
        return [a for a in self.anchors.values() if a.covers(edge) >= max(1, min_length)]

    def add(self, anchor_id: str, edge: str, base_k: torch.Tensor, base_v: torch.Tensor, delta_k: torch.Tensor,
            delta_v: torch.Tensor, rank_base: int | None, rank_delta: int | None, dtype: torch.dtype,
            base_codec: BaseCodec | None = None) -> None:
        """Add a consumer's correction to the anchor of this content, creating it if needed. An
        anchor's corrections all come from its own source's cache: a correction observed from
        another source (another edge's source) needs an anchor of its own, named apart.
        `base_codec` keeps a full-size base (rank_base None) compressed; corrections stay as they
        are (they are applied to the served cache, a base only serves matching)."""
        source = edge_source(edge)
        anchor = self.anchors.get(anchor_id)
        if anchor is not None and anchor.source != source:
            raise ValueError(f"anchor {anchor_id!r} holds {anchor.source}'s cache as its base; a correction "
                             f"observed on edge {edge} needs an anchor of its own")
        if anchor is None:
            if base_codec is not None and rank_base is None:
                bases: tuple[Stored, Stored] = (Coded(base_k, base_codec.codec, base_codec.head_dim, False, dtype),
                                                Coded(base_v, base_codec.codec, base_codec.head_dim, True, dtype))
            else:
                bases = (store(base_k, rank_base, dtype), store(base_v, rank_base, dtype))
            # Evict before inserting, as the paper (a full pool makes room) and KVComm's code do:
            # inserting first let a newcomer (0 uses) be the least used of the window when V < 5,
            # so it was evicted at once and the first used anchor stayed forever.
            while len(self.anchors) >= self.capacity:
                self.evict()
            anchor = Anchor(anchor_id, source, *bases)
            self.anchors[anchor_id] = anchor
        anchor.deltas[edge] = (store(delta_k, rank_delta, dtype), store(delta_v, rank_delta, dtype))

    def merge(self, anchor: Anchor) -> None:
        """Another instance's anchor (kvbench.methods.delta.shared_anchors): a new id joins the pool
        (evicting as `add` does); a known one gains the corrections it lacks, when its base is from
        the same source (ValueError otherwise)."""
        held = self.anchors.get(anchor.anchor_id)
        if held is None:
            while len(self.anchors) >= self.capacity:
                self.evict()
            self.anchors[anchor.anchor_id] = anchor
            return
        if held.source != anchor.source or held.length != anchor.length:
            raise ValueError(f"anchor {anchor.anchor_id!r} here holds {held.source}'s {held.length} rows, the other "
                             f"instance's {anchor.source}'s {anchor.length}")
        for edge, correction in anchor.deltas.items():
            held.deltas.setdefault(edge, correction)

    def evict(self) -> str:
        """Least frequently used among the oldest EVICTION_WINDOW anchors (ties: the oldest)."""
        window = list(self.anchors.values())[:EVICTION_WINDOW]
        victim = min(window, key=lambda a: a.uses)  # min() keeps the first (oldest) of equals
        del self.anchors[victim.anchor_id]
        return victim.anchor_id

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors.values())


@dataclass
class GateResult:
    accept: bool
    weights: torch.Tensor  # [anchors]
    normalized_entropy: float


def _rows_into(s: Stored, layer: int, n: int, out: torch.Tensor, minus: torch.Tensor | None = None) -> None:
    """Rows [0, n) of one layer of a stored tensor into `out` [n, D] (storage dtype), less `minus`
    [n, D] (same dtype) when given. Low-rank factors are multiplied straight into `out` (bf16
    GEMMs accumulate in fp32 and run on AVX512-BF16/AMX or tensor cores), the subtraction fused
    into the GEMM (beta = -1): no stacking copies, no extra pass."""
    if isinstance(s, FullRank | Coded):
        rows = s.z[layer, :n] if isinstance(s, FullRank) else s.layer_rows(layer, n).to(out.dtype)
        if minus is None:
            out.copy_(rows)
        else:
            torch.sub(rows, minus, out=out)
    elif minus is None:
        torch.mm(s.a[layer, :n], s.b[layer], out=out)
    else:
        torch.addmm(minus, s.a[layer, :n], s.b[layer], beta=-1, out=out)


def anchor_distances(current: torch.Tensor, stored: list[Stored], n: int, gate_rows: int = 0,
                     per_token: bool = True, path: str | None = None,
                     squares_per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Distances between the current cache [layers, >=n, D] and each stored base, in one pass
    per layer: ([anchors, n] absolute differences summed over layers and features, for the
    token-wise weights; [anchors] squared differences summed over the first `gate_rows` rows and
    all layers, for the gate of Eq. 9). `squares_per_row`: the squared differences are left per
    row, [anchors, gate_rows] (summed over layers and features only), so that a gate over any
    first k <= gate_rows rows can be taken from them later.

    `path`: "loop" (a GEMM per anchor and layer), "batched" (one batched GEMM per layer for all
    low-rank anchors of one rank), "fused" (one Triton kernel per layer, CUDA, bf16/fp16 factors).
    Default: fused where it can run, else batched on accelerators and loop on the CPU, where bf16
    bmm took three times as long as the loop (79 vs 24 ms at V=10, [4, 8192, 128], measured)."""
    count = len(stored)
    paths = distance_paths(stored, current.device)
    if path is None:
        path = paths[0]
    if path not in paths:
        raise ValueError(f"distance path {path!r} cannot run here (possible: {', '.join(paths)})")
    if path == "fused":
        from kvbench.methods.delta.triton_distances import low_rank_distances

        rows = n if per_token else gate_rows
        l1, l2 = low_rank_distances(current, *_low_rank_stack(stored, rows), rows)
        if squares_per_row:
            squares = l2[:, :gate_rows]
        else:
            squares = l2[:, :gate_rows].sum(dim=-1) if gate_rows else torch.zeros(count, device=current.device)
        return (l1 if per_token else l1[:, :0]), squares
    stack = _low_rank_stack(stored, n) if path == "batched" else None
    sums = torch.zeros(count, n if per_token else 0, device=current.device)
    squares = torch.zeros(count, gate_rows, device=current.device) if squares_per_row else \
        torch.zeros(count, device=current.device)

    def accumulate(diff: torch.Tensor, into: slice) -> None:
        """Reductions of differences [anchors, n, D] over features stay in the storage dtype
        (accumulated in fp32 inside, several times faster on the CPU than fp32 outputs); sums
        over tokens and layers in fp32."""
        if gate_rows:
            gate = diff[:, :gate_rows]
            per_row = torch.linalg.vecdot(gate, gate).float()
            squares[into] += per_row if squares_per_row else per_row.sum(dim=-1)
        if per_token:
            sums[into] += diff.abs_().sum(dim=-1).float()

    dtype, device = stored_dtype_device(stored[0])
    buffer = None if stack is not None else torch.empty(1, n, stored[0].shape[-1], dtype=dtype, device=device)
    for layer in range(current.shape[0]):
        if stack is not None:  # A B - c for all anchors in one batched GEMM (beta = -1)
            a, b = stack[0][layer], stack[1][layer]
            rows = current[layer, :n].to(a.dtype)
            accumulate(torch.baddbmm(rows.expand(count, *rows.shape), a, b, beta=-1), slice(None))
            continue
        # One anchor at a time through one [n, D] buffer: its reductions read it while it is
        # still in cache. A [anchors, n, D] stack took twice as long at V = 10 on the CPU (43 vs
        # 23 ms at [4, 8192, 128], measured), its passes running from memory.
        rows = current[layer, :n].to(dtype)
        for index, s in enumerate(stored):
            _rows_into(s, layer, n, buffer[0], minus=rows)
            accumulate(buffer, slice(index, index + 1))
    return sums, squares


def distance_paths(stored: list[Stored], device: torch.device) -> list[str]:
    """The paths `anchor_distances` can take for these anchors on this device, its default first:
    fused where it can run, else batched on accelerators and the loop on the CPU."""
    low_rank = _one_rank(stored)
    fused = (low_rank and stored[0].b.dtype in (torch.bfloat16, torch.float16)  # type: ignore[union-attr]
             and _triton_available(device))
    if not low_rank:
        return ["loop"]
    return (["fused"] if fused else []) + (["batched", "loop"] if device.type != "cpu" else ["loop", "batched"])


def _triton_available(device: torch.device) -> bool:
    """The fused kernel runs on CUDA devices where Triton imports (CPU workers never import it)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _one_rank(stored: list[Stored]) -> bool:
    """Every stored tensor is low rank, all of one rank."""
    return all(isinstance(s, LowRank) for s in stored) and len({s.a.shape[-1] for s in stored}) == 1  # type: ignore[union-attr]


def _low_rank_stack(stored: list[Stored], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [layers, anchors, n, r] and B [layers, anchors, r, D] of low-rank tensors of one rank.
    Copying the thin factors once (r << D) lets each layer's pass be one batched GEMM or kernel
    launch instead of one per anchor: on a GPU the per-anchor launches, not the bytes, were the
    cost (an 8K segment took as long as a 32K one)."""
    return (torch.stack([s.a[:, :n] for s in stored], dim=1),  # type: ignore[union-attr]
            torch.stack([s.b for s in stored], dim=1))  # type: ignore[union-attr]


def gate_from_distances(squared: torch.Tensor, tau: float, temperature: float = 1.0) -> GateResult:
    """Eq. 10-11 from the squared distances of Eq. 9: softmax over anchors of minus the distance;
    accept when the normalized entropy is at most tau. Fewer than two anchors: reject."""
    count = len(squared)
    if count < 2:
        return GateResult(False, torch.ones(count), math.nan)
    weights = torch.softmax(-torch.sqrt(squared.double().cpu()) / temperature, dim=0)
    entropy = float(-(weights * torch.log2(weights.clamp_min(1e-300))).sum() / math.log2(count))
    return GateResult(entropy <= tau, weights.float(), entropy)


def reliability_gate(current_v: torch.Tensor, anchors: list[Anchor], k: int, tau: float,
                     temperature: float = 1.0) -> GateResult:
    """Eq. 9-11: distance of the value states over the first k tokens, all layers; softmax over
    anchors; accept when the normalized entropy is at most tau. Fewer than two anchors: reject."""
    if len(anchors) < 2:
        return GateResult(False, torch.ones(len(anchors)), math.nan)
    _, squares = anchor_distances(current_v, [a.base_v for a in anchors], k, gate_rows=k, per_token=False)
    return gate_from_distances(squares, tau, temperature)


def token_weights(distance_sums: torch.Tensor, layers: int, features: int, temperature: float = 1.0) -> torch.Tensor:
    """Softmax over anchors, per token, of minus the mean absolute distance (over layers, features)."""
    return torch.softmax(-distance_sums / (layers * features) / temperature, dim=0)


class Correction:
    """Eq. 8 for rows [0, n) of one segment: sum over anchors of w_v[t] * delta_v[t], kept as the
    anchors' stored corrections and the weights, and reconstructed one layer at a time where it is
    applied. No [layers, n, D] copy of the correction is ever made (on Llama-3.1-8B at 8K, K and V
    corrections for all layers would be 1 GiB). `weights` [anchors, n]; None: one correction,
    weight 1 (GraphFlow's calibrated relation; the sole anchor of a pool of one)."""

    def __init__(self, deltas: list[Stored], weights: torch.Tensor | None, n: int) -> None:
        if weights is None and len(deltas) != 1:
            raise ValueError("a correction without weights takes exactly one stored delta")
        self.deltas, self.weights, self.n = deltas, weights, n

    def _scaled_factors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, anchors*r] (the weights folded into the A factors) and the stacked B [anchors*r, D]:
        their product is this layer's correction, one GEMM with no per-anchor [n, D] reconstruction."""
        first = self.deltas[0].a  # type: ignore[union-attr]
        if self.weights is None:
            return first[layer, :self.n], self.deltas[0].b[layer]  # type: ignore[union-attr]
        scaled = torch.empty(self.n, len(self.deltas), first.shape[-1], dtype=first.dtype, device=first.device)
        for index, d in enumerate(self.deltas):  # w_v[t] * A_v[t], written into its slice of [n, V, r]
            torch.mul(d.a[layer, :self.n], self.weights[index, :, None].to(first.dtype), out=scaled[:, index])  # type: ignore[union-attr]
        return scaled.view(self.n, -1), torch.cat([d.b[layer] for d in self.deltas])  # type: ignore[union-attr]

    def layer(self, layer: int) -> torch.Tensor:
        """This layer's correction [n, D]: in the storage dtype (low rank, one GEMM), or summed in
        fp32 one anchor at a time (full-dimensional: a [anchors, n, D] stack and an einsum took
        35 ms per layer at V = 20, [8192, 128] on the CPU, against 3 ms, measured)."""
        if _one_rank(self.deltas):
            a, b = self._scaled_factors(layer)
            return a @ b
        if self.weights is None:
            return self.deltas[0].rows(self.n, layer)
        first = self.deltas[0]  # low-rank ones of other ranks (segments shorter than r) land here too
        device = (first.z if isinstance(first, FullRank) else first.b).device
        out = torch.zeros(self.n, first.shape[-1], device=device)
        for weights, d in zip(self.weights, self.deltas):
            out.addcmul_(d.rows(self.n, layer) if isinstance(d, LowRank) else d.z[layer, :self.n], weights[:, None])
        return out

    def add_to(self, layer: int, out: torch.Tensor,
               rotate: Callable[[torch.Tensor, bool], torch.Tensor] | None = None) -> None:
        """out[:n] += this layer's correction, in place; out is [>= n, D]. `rotate(x, exact)` maps
        rows [m, D] from canonical to target positions (keys). RoPE is linear in the features, so a
        low-rank correction is rotated through its B factors (anchors*r rows, exactly) rather than
        its n reconstructed rows, and added inside the GEMM (beta = 1: one rounding, no extra pass)."""
        target = out[:self.n]
        if _one_rank(self.deltas):
            a, b = self._scaled_factors(layer)
            if rotate is not None:
                b = rotate(b, True)
            if target.dtype == a.dtype and target.is_contiguous():
                target.addmm_(a, b.to(a.dtype))
            else:
                target += (a @ b.to(a.dtype)).to(target.dtype)
            return
        rows = self.layer(layer)  # fp32 [n, D]
        if rotate is not None:
            rows = rotate(rows, True)
        target += rows.to(target.dtype)


def weighted_corrections(deltas: list[Stored], weights: torch.Tensor, layers: int, n: int) -> torch.Tensor:
    """Sum over anchors of w_v[t] * delta_v[t] for rows [0, n), as [layers, n, D] (the storage dtype
    for low rank, fp32 otherwise), every layer materialized: for tests and timing scripts; the
    methods apply a `Correction` layer by layer."""
    correction = Correction(deltas, weights, n)
    return torch.stack([correction.layer(layer) for layer in range(layers)])


def token_weighted_corrections(anchors: list[Anchor], edge: str, n: int, key_distances: torch.Tensor,
                               value_distances: torch.Tensor, features: int,
                               temperature: float = 1.0) -> tuple[Correction, Correction]:
    """Eq. 8 with token-wise weights from distances already summed over ranks: for each token,
    softmax over anchors of minus the mean absolute distance (over layers and all ranks'
    `features`), K and V separately. The corrections are applied layer by layer (`Correction`)."""
    layers = anchors[0].base_v.shape[0]
    w_k = token_weights(key_distances, layers, features, temperature)
    w_v = token_weights(value_distances, layers, features, temperature)
    return (Correction([a.deltas[edge][0] for a in anchors], w_k, n),
            Correction([a.deltas[edge][1] for a in anchors], w_v, n))


def interpolated_delta(current_k: torch.Tensor | None, current_v: torch.Tensor | None, anchors: list[Anchor],
                       edge: str, n: int, temperature: float = 1.0,
                       value_distances: torch.Tensor | None = None,
                       path: str | None = None,
                       sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       ranks: int = 1,
                       key_distances: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 8 with token-wise weights: for each token, softmax over anchors of minus the mean
    absolute distance between the current cache and the anchor's base (K and V separately),
    then the weighted sum of the anchors' corrections. Rows [0, n) only.

    Distances given (the gate's value pass, memoized ones) must already be summed over ranks; a
    current cache is needed only for the distances not given (computed along `path`). Under
    tensor parallelism each of the `ranks` holds some heads: computed distances are summed over
    them with `sum_over_ranks`, and the mean is over all their features."""
    layers, _, width = anchors[0].base_v.shape
    features = width * ranks
    if value_distances is None:
        assert current_v is not None, "value distances need the current values"
        value_distances, _ = anchor_distances(current_v, [a.base_v for a in anchors], n, path=path)
        if sum_over_ranks is not None:
            value_distances = sum_over_ranks(value_distances)
    if key_distances is None:
        assert current_k is not None, "key distances need the current keys"
        key_distances, _ = anchor_distances(current_k, [a.base_k for a in anchors], n, path=path)
        if sum_over_ranks is not None:
            key_distances = sum_over_ranks(key_distances)
    correction_k, correction_v = token_weighted_corrections(anchors, edge, n, key_distances, value_distances,
                                                            features, temperature)
    return (torch.stack([correction_k.layer(layer) for layer in range(layers)]),
            torch.stack([correction_v.layer(layer) for layer in range(layers)]))
