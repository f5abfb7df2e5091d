"""Key re-rotation: the constant-shift GEMM path against the elementwise per-row path."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.core.rope import RopeAligner


@pytest.mark.parametrize("neox", [True, False])
def test_constant_shift_matches_per_row_rotation(neox: bool) -> None:
    aligner = RopeAligner.from_theta(32, 8192, 500000.0, neox=neox)
    keys = torch.randn(2, 50, 4, 32, generator=torch.Generator().manual_seed(0))
    # One row with another shift forces the per-row (elementwise) path for the other rows.
    per_row = aligner.rotate(keys, torch.tensor([1234] * 49 + [7]))[:, :49]
    constant = aligner.rotate(keys, 1234)[:, :49]
    assert torch.allclose(constant, per_row, atol=1e-5)
    assert not torch.allclose(constant, keys[:, :49], atol=1e-2)  # it did rotate
    assert torch.allclose(aligner.rotate(aligner.rotate(keys, 3000), -3000), keys, atol=1e-5)


def test_inexact_rotation_of_a_strided_bf16_slice() -> None:
    """exact=False multiplies in bf16 (matching distances, small corrections): within 1% of the
    fp32 result, also for a row slice of a larger saved cache (a strided view)."""
    aligner = RopeAligner.from_theta(32, 8192, 500000.0)
    saved = torch.randn(2, 300, 4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    rows = saved[:, 40:240]
    assert not rows.is_contiguous()
    fast = aligner.rotate(rows, -40, exact=False)
    exact = aligner.rotate(rows.float(), -40)
    assert fast.dtype == torch.bfloat16 and fast.shape == rows.shape
    assert float((fast.float() - exact).norm() / exact.norm()) < 0.01
