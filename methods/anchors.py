"""Anchor pools for delta correction (KVComm, KVCMAS): storage, factorization, the reliability
gate and token-wise interpolation. Pure tensor code, independent of vLLM.

Shapes: a cache of one segment is [layers, tokens, features] with features = KV heads x head dim;
keys are kept in canonical positions (the segment rotated as if it started at position 0).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

EVICTION_WINDOW = 5  # LFU among the 5 oldest anchors (KVComm's policy, kept by KVCMAS)


class FullRank:
    """A [layers, n, D] tensor stored as is (KVComm)."""

    def __init__(self, z: torch.Tensor, dtype: torch.dtype) -> None:
        self.z = z.to(dtype)

    @property
    def length(self) -> int:
        return self.z.shape[1]

    def rows(self, n: int, layer: int | None = None) -> torch.Tensor:
        return (self.z[:, :n] if layer is None else self.z[layer, :n]).float()

    @property
    def nbytes(self) -> int:
        return self.z.nbytes


class LowRank:
    """Truncated SVD per layer, Z ~ A B with A = U_r S_r [layers, n, r] and B = V_r^T [layers, r, D]."""

    def __init__(self, z: torch.Tensor, rank: int, dtype: torch.dtype) -> None:
        # The right singular vectors of a tall Z [n, D] are the eigenvectors of its Gram matrix
        # Z^T Z [D, D]: one small symmetric eigensolve per layer (fp64 for the squared condition
        # number) and one GEMM give the same rank-r factors as an SVD of Z, 4-5x faster on CPU
        # (14 vs 64 ms at [4, 8192, 128]); this runs for every dense fallback.
        z = z.float()
        r = min(rank, z.shape[-2], z.shape[-1])
        _, eigenvectors = torch.linalg.eigh((z.mT @ z).double())  # ascending eigenvalues
        b = eigenvectors[..., -r:].flip(-1).mT.to(z.dtype)  # top-r right singular vectors [layers, r, D]
        self.a = (z @ b.mT).to(dtype)  # = U_r S_r
        self.b = b.to(dtype)

    @property
    def length(self) -> int:
        return self.a.shape[1]

    def rows(self, n: int, layer: int | None = None) -> torch.Tensor:
        # In the storage dtype: bf16 GEMMs accumulate in fp32 and run on the CPU's AMX/GPU tensor cores.
        if layer is not None:
            return torch.matmul(self.a[layer, :n], self.b[layer]).float()
        return torch.matmul(self.a[:, :n], self.b).float()

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


Stored = FullRank | LowRank


def store(z: torch.Tensor, rank: int | None, dtype: torch.dtype) -> Stored:
    return FullRank(z, dtype) if rank is None else LowRank(z, rank, dtype)


@dataclass
class Anchor:
    """One observed content of a slot: its base cache and the corrections its consumers needed."""

    anchor_id: str
    base_k: Stored
    base_v: Stored
    deltas: dict[str, tuple[Stored, Stored]] = field(default_factory=dict)  # edge -> (dK, dV)
    uses: int = 0

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
            delta_v: torch.Tensor, rank_base: int | None, rank_delta: int | None, dtype: torch.dtype) -> None:
        """Add a consumer's correction to the anchor of this content, creating it if needed."""
        anchor = self.anchors.get(anchor_id)
        if anchor is None:
            anchor = Anchor(anchor_id, store(base_k, rank_base, dtype), store(base_v, rank_base, dtype))
            self.anchors[anchor_id] = anchor
            while len(self.anchors) > self.capacity:
                self.evict()
        anchor.deltas[edge] = (store(delta_k, rank_delta, dtype), store(delta_v, rank_delta, dtype))

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


def _stacked_rows(stored: list[Stored], layer: int, n: int) -> torch.Tensor:
    """Rows [0, n) of one layer of every stored tensor, as one [anchors, n, D] tensor in the
    storage dtype. Low-rank factors are multiplied straight into their slice of the output (bf16
    GEMMs accumulate in fp32 and run on AVX512-BF16/AMX or tensor cores): no stacking copies."""
    first = stored[0].z if isinstance(stored[0], FullRank) else stored[0].b
    out = torch.empty(len(stored), n, first.shape[-1], dtype=first.dtype, device=first.device)
    for index, s in enumerate(stored):
        if isinstance(s, FullRank):
            out[index] = s.z[layer, :n]
        else:
            torch.mm(s.a[layer, :n], s.b[layer], out=out[index])
    return out


def anchor_distances(current: torch.Tensor, stored: list[Stored], n: int, gate_rows: int = 0,
                     per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Distances between the current cache [layers, >=n, D] and each stored base, in one pass
    per layer: ([anchors, n] absolute differences summed over layers and features, for the
    token-wise weights; [anchors] squared differences summed over the first `gate_rows` rows and
    all layers, for the gate of Eq. 9)."""
    count = len(stored)
    sums = torch.zeros(count, n if per_token else 0, device=current.device)
    squares = torch.zeros(count, device=current.device)
    for layer in range(current.shape[0]):  # one [anchors, n, D] reconstruction alive at a time
        diff = _stacked_rows(stored, layer, n)
        diff.sub_(current[layer, :n].to(diff.dtype))  # in place: the pass is memory-bound
        # Reductions over features stay in the storage dtype (accumulated in fp32 inside, and
        # several times faster on the CPU than fp32 outputs); sums over tokens and layers in fp32.
        if gate_rows:
            gate = diff[:, :gate_rows]
            squares += torch.linalg.vecdot(gate, gate).float().sum(dim=-1)
        if per_token:
            sums += diff.abs_().sum(dim=-1).float()
    return sums, squares


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


def weighted_corrections(deltas: list[Stored], weights: torch.Tensor, layers: int, n: int) -> torch.Tensor:
    """Sum over anchors of w_v[t] * delta_v[t] for rows [0, n), as [layers, n, D] in the storage dtype.
    Low rank: one GEMM per layer, [n, anchors*r] (weights folded into the A factors) times the
    stacked B factors [anchors*r, D]; no [n, D] reconstruction per anchor."""
    low_rank = all(isinstance(d, LowRank) for d in deltas) and len({d.a.shape[-1] for d in deltas}) == 1  # type: ignore[union-attr]
    out = []
    for layer in range(layers):
        if low_rank:
            first = deltas[0].a  # type: ignore[union-attr]
            scaled = torch.empty(n, len(deltas), first.shape[-1], dtype=first.dtype, device=first.device)
            for index, d in enumerate(deltas):  # w_v[t] * A_v[t], written into its slice of [n, V, r]
                torch.mul(d.a[layer, :n], weights[index, :, None].to(first.dtype), out=scaled[:, index])  # type: ignore[union-attr]
            b = torch.cat([d.b[layer] for d in deltas])  # type: ignore[union-attr]  [V*r, D]
            out.append(scaled.view(n, -1) @ b)
        else:
            rows = _stacked_rows(deltas, layer, n)
            out.append(torch.einsum("vn,vnd->nd", weights.to(rows.dtype), rows))
    return torch.stack(out)


def interpolated_delta(current_k: torch.Tensor, current_v: torch.Tensor, anchors: list[Anchor], edge: str,
                       n: int, temperature: float = 1.0,
                       value_distances: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 8 with token-wise weights: for each token, softmax over anchors of minus the mean
    absolute distance between the current cache and the anchor's base (K and V separately),
    then the weighted sum of the anchors' corrections. Rows [0, n) only; the value distances may
    come from the gate's pass (`anchor_distances`)."""
    layers, features = current_v.shape[0], current_v.shape[2]
    if value_distances is None:
        value_distances, _ = anchor_distances(current_v, [a.base_v for a in anchors], n)
    key_distances, _ = anchor_distances(current_k, [a.base_k for a in anchors], n)
    w_k = token_weights(key_distances, layers, features, temperature)
    w_v = token_weights(value_distances, layers, features, temperature)
    delta_k = weighted_corrections([a.deltas[edge][0] for a in anchors], w_k, layers, n)
    delta_v = weighted_corrections([a.deltas[edge][1] for a in anchors], w_v, layers, n)
    return delta_k, delta_v
