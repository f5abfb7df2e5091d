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

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate keys [n, H, hd] by the angle of `delta` [n] positions (negative allowed)."""
        if len(delta) == 0 or not bool((delta != 0).any()):
            return keys
        if int(delta.abs().max()) >= len(self.cos):
            raise ValueError(f"position shift {int(delta.abs().max())} exceeds the rotary table")
        delta = delta.to(self.cos.device)
        magnitude = delta.abs()
        cos = self.cos.index_select(0, magnitude).unsqueeze(1)
        sin = (self.sin.index_select(0, magnitude) * torch.sign(delta).to(self.sin).unsqueeze(-1)).unsqueeze(1)
        x = keys.float()
        rot = x[..., : self.rotary_dim]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # GPT-J style: interleaved pairs
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if self.rotary_dim < x.shape[-1]:
            out = torch.cat((out, x[..., self.rotary_dim:]), dim=-1)
        return out.to(keys.dtype)
