"""Moving keys between positions with the model's own rotary table (re-alignment of reused K)."""

from __future__ import annotations

import torch

MAX_CACHED_MATRICES = 4096  # one [hd, hd] matrix per (shift, dtype): a few KiB each


class RopeAligner:
    """Re-rotates keys computed at source positions to target positions: RoPE is a rotation by an
    angle linear in the position, so rotating by (target - source) re-aligns a cached key."""

    @classmethod
    def from_theta(cls, head_dim: int, max_positions: int, theta: float, neox: bool = True) -> RopeAligner:
        """A plain (unscaled) RoPE table, for use outside a vLLM model (benchmarks, tests)."""
        aligner = cls.__new__(cls)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        aligner.cos, aligner.sin = angles.cos().float(), angles.sin().float()
        aligner.rotary_dim, aligner.is_neox_style = head_dim, neox
        aligner._matrices = {}
        return aligner

    def to(self, device: torch.device | str) -> RopeAligner:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self._matrices = {}
        return self

    def __init__(self, rotary_emb: torch.nn.Module) -> None:
        # fp32 copy of the table: the module's own buffer is cast to the activation dtype.
        cos_sin = rotary_emb._compute_cos_sin_cache().float()
        cos, sin = cos_sin.chunk(2, dim=-1)
        # Scaled variants (YaRN multiply cos and sin by mscale) are not pure rotations; the
        # re-rotation must be one, so normalize each (cos, sin) pair.
        norm = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-12)
        self.cos = cos / norm
        self.sin = sin / norm
        self.rotary_dim = int(rotary_emb.rotary_dim)
        self.is_neox_style = bool(rotary_emb.is_neox_style)
        self._matrices: dict[tuple[int, int, str, torch.dtype], torch.Tensor] = {}

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor | int, exact: bool = True) -> torch.Tensor:
        """Rotate keys [..., n, H, hd] by the angle of `delta` positions: one shift per row ([n],
        negative allowed) or one for all rows (an int, or a constant tensor: the common case of a
        segment moved as a whole).

        A constant shift is one [hd, hd] rotation matrix for every row, applied as a GEMM (several
        times faster than the elementwise form on CPU). `exact=False` multiplies in the keys' own
        dtype: bf16 matrix entries put about 0.4% error on the result, which is fine for matching
        distances and for rotating small corrections, not for the reused keys themselves."""
        if isinstance(delta, torch.Tensor):
            if len(delta) == 0:
                return keys
            low, high = int(delta.min()), int(delta.max())
            if low == high:
                delta = low
        if isinstance(delta, int):
            if delta == 0:
                return keys
            self._check(abs(delta))
            if not exact:
                # contiguous(): a bf16 matmul of a strided view (a row slice of a saved cache) takes
                # a batched slow path, 30x slower on the CPU than the copy plus one GEMM.
                return torch.matmul(keys.contiguous(), self._shift_matrix(delta, keys.shape[-1], keys.device,
                                                                          keys.dtype))
            matrix = self._shift_matrix(delta, keys.shape[-1], keys.device, torch.float32)
            return torch.matmul(keys.float(), matrix).to(keys.dtype)
        self._check(max(abs(low), abs(high)))
        delta = delta.to(self.cos.device)
        magnitude = delta.abs()
        cos = self.cos.index_select(0, magnitude).unsqueeze(1)
        sin = (self.sin.index_select(0, magnitude) * torch.sign(delta).to(self.sin).unsqueeze(-1)).unsqueeze(1)
        return self._rotate_elementwise(keys.float(), cos, sin).to(keys.dtype)

    def _rotate_elementwise(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        half, rd = self.rotary_dim // 2, self.rotary_dim
        if self.is_neox_style:
            x1, x2, o1, o2 = x[..., :half], x[..., half:rd], out[..., :half], out[..., half:rd]
        else:  # GPT-J style: interleaved pairs
            x1, x2, o1, o2 = x[..., 0:rd:2], x[..., 1:rd:2], out[..., 0:rd:2], out[..., 1:rd:2]
        # Written into slices of one output: no concatenation of halves.
        o1.copy_(x1 * cos).sub_(x2 * sin)
        o2.copy_(x2 * cos).add_(x1 * sin)
        if rd < x.shape[-1]:
            out[..., rd:] = x[..., rd:]
        return out

    def _shift_matrix(self, delta: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """M with rotate(x, delta) == x @ M: row i is the rotated i-th basis vector (RoPE is linear)."""
        key = (delta, head_dim, str(device), dtype)
        matrix = self._matrices.get(key)
        if matrix is None:
            sign = 1.0 if delta > 0 else -1.0
            cos, sin = self.cos[abs(delta)], sign * self.sin[abs(delta)]
            eye = torch.eye(head_dim, dtype=torch.float32, device=self.cos.device)
            matrix = self._rotate_elementwise(eye, cos, sin).to(device=device, dtype=dtype)
            if len(self._matrices) >= MAX_CACHED_MATRICES:
                self._matrices.pop(next(iter(self._matrices)))
            self._matrices[key] = matrix
        return matrix

    def _check(self, largest: int) -> None:
        if largest >= len(self.cos):
            raise ValueError(f"position shift {largest} exceeds the rotary table")
