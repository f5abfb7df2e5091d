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
        u, s, vh = torch.linalg.svd(z.float(), full_matrices=False)
        r = min(rank, s.shape[-1])
        self.a = (u[..., :r] * s[..., None, :r]).to(dtype)
        self.b = vh[..., :r, :].to(dtype)

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


def reliability_gate(current_v: torch.Tensor, anchors: list[Anchor], k: int, tau: float,
                     temperature: float = 1.0) -> GateResult:
    """Eq. 9-11: distance of the value states over the first k tokens, all layers; softmax over
    anchors; accept when the normalized entropy is at most tau. Fewer than two anchors: reject."""
    if len(anchors) < 2:
        return GateResult(False, torch.ones(len(anchors)), math.nan)
    distances = torch.zeros(len(anchors), device=current_v.device)
    for layer in range(current_v.shape[0]):  # one [k, D] reconstruction alive at a time
        current = current_v[layer, :k].float()
        for index, anchor in enumerate(anchors):
            distances[index] += ((current - anchor.base_v.rows(k, layer)) ** 2).sum()
    distances = torch.sqrt(distances)
    weights = torch.softmax(-distances / temperature, dim=0)
    entropy = float(-(weights * torch.log2(weights.clamp_min(1e-30))).sum() / math.log2(len(anchors)))
    return GateResult(entropy <= tau, weights, entropy)


def interpolated_delta(current_k: torch.Tensor, current_v: torch.Tensor, anchors: list[Anchor], edge: str,
                       n: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 8 with token-wise weights: for each token, softmax over anchors of minus the mean
    absolute distance between the current cache and the anchor's base (K and V separately),
    then the weighted sum of the anchors' corrections. Rows [0, n) only.

    Works layer by layer so that only one [n, D] reconstruction is alive at a time."""
    layers, features = current_v.shape[0], current_v.shape[2]
    distance_k = torch.zeros(len(anchors), n, device=current_v.device)
    distance_v = torch.zeros(len(anchors), n, device=current_v.device)
    for layer in range(layers):
        cur_k, cur_v = current_k[layer, :n].float(), current_v[layer, :n].float()
        for index, anchor in enumerate(anchors):
            distance_k[index] += (cur_k - anchor.base_k.rows(n, layer)).abs().sum(dim=-1)
            distance_v[index] += (cur_v - anchor.base_v.rows(n, layer)).abs().sum(dim=-1)
    scale = layers * features  # sums -> means over (layers, features)
    w_k = torch.softmax(-distance_k / scale / temperature, dim=0)
    w_v = torch.softmax(-distance_v / scale / temperature, dim=0)
    delta_k = torch.zeros(layers, n, features, device=current_v.device)
    delta_v = torch.zeros_like(delta_k)
    for layer in range(layers):
        for index, anchor in enumerate(anchors):
            dk, dv = anchor.deltas[edge]
            delta_k[layer] += w_k[index][:, None] * dk.rows(n, layer)
            delta_v[layer] += w_v[index][:, None] * dv.rows(n, layer)
    return delta_k, delta_v
