"""The fused Triton distance kernel (CUDA's path) computes what the torch loop computes.

Run on the CPU under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess because Triton
reads it at import). The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton
#11584, unsupported), so this checks the kernel's indexing, masks, rank padding and accumulation
over layers with fp16 factors; tests/unit/methods/test_gpu_paths.py checks bf16 on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

CHECK = """
import torch
from kvbench.methods.delta import anchors
from kvbench.methods.delta.anchors import anchor_distances
from kvbench.methods.delta.stored import LowRank

anchors._triton_available = lambda device: True  # the interpreter runs the kernel on CPU tensors
g = torch.Generator().manual_seed(7)
layers, features, n = 3, 160, 70  # features and n not multiples of the kernel's blocks
for rank in (8, 24):  # padded to tl.dot's 16 and to a power of two
    stored = [LowRank.from_factors(torch.randn(layers, 80, rank, generator=g).half(),
                                   (torch.randn(layers, rank, features, generator=g) / rank**0.5).half())
              for _ in range(3)]
    current = torch.randn(layers, 90, features, generator=g).half()
    for gate_rows, per_token in ((30, True), (n, True), (20, False)):
        sums, squares = anchor_distances(current, stored, n, gate_rows, per_token, path="loop")
        fused_sums, fused_squares = anchor_distances(current, stored, n, gate_rows, per_token, path="fused")
        assert fused_sums.shape == sums.shape and fused_squares.shape == (3,)
        assert torch.allclose(fused_sums, sums, rtol=2e-3), (rank, gate_rows, (fused_sums - sums).abs().max())
        assert torch.allclose(fused_squares, squares, rtol=2e-3), (rank, gate_rows)
print("ok")
"""


def test_fused_kernel_matches_the_loop_under_the_interpreter() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
