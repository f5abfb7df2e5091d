"""Moving keys between positions with the model's own rotary table (re-alignment of reused K)."""

from __future__ import annotations

import torch


class RopeAligner:
    """Re-rotates keys computed at source positions to target positions: RoPE is a rotation by an
    angle linear in the position, so rotating by (target - source) re-aligns a cached key."""

    @classmethod
    def from_theta(cls, head_dim: int, max_positions: int, theta: float, neox: bool = True) -> "RopeAligner":
        """A plain (unscaled) RoPE table, for use outside a vLLM model (benchmarks, tests)."""
        aligner = cls.__new__(cls)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        aligner.cos, aligner.sin = angles.cos().float(), angles.sin().float()
        aligner.rotary_dim, aligner.is_neox_style = head_dim, neox
        return aligner

    def to(self, device: torch.device | str) -> "RopeAligner":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
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

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
        """Rotate keys [..., n, H, hd] by the angle of `delta` positions: one shift per row ([n],
        negative allowed) or one for all rows (an int, or a constant tensor: the common case of a
        segment moved as a whole, which needs no per-row table lookup)."""
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
            sign = 1.0 if delta > 0 else -1.0
            cos, sin = self.cos[abs(delta)], sign * self.sin[abs(delta)]  # [rotary_dim / 2], broadcast
        else:
            self._check(max(abs(low), abs(high)))
            delta = delta.to(self.cos.device)
            magnitude = delta.abs()
            cos = self.cos.index_select(0, magnitude).unsqueeze(1)
            sin = (self.sin.index_select(0, magnitude) * torch.sign(delta).to(self.sin).unsqueeze(-1)).unsqueeze(1)
        x = keys.float()
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
        return out.to(keys.dtype)

    def _check(self, largest: int) -> None:
        if largest >= len(self.cos):
            raise ValueError(f"position shift {largest} exceeds the rotary table")
