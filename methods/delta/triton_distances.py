"""Anchor distances on CUDA in one fused Triton kernel: reconstruct A B tile by tile, subtract the
current cache and reduce |diff| and diff^2 per token, without writing the [anchors, n, D]
reconstruction to memory. The torch path writes it and reads it back three times; on an H200 at
Llama-3.1-8B shapes that ran at 0.01 of the copy bandwidth counted on the bytes the pass needs.

Imported by `anchors.anchor_distances` only for low-rank bf16/fp16 anchors on CUDA, so that
CPU workers never import Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_D = 64, 128


@triton.jit
def _distances_kernel(a_ptr, b_ptr, c_ptr, l1_ptr, l2_ptr, n, features, rank,
                      stride_a_anchor, stride_a_row, stride_b_anchor, stride_b_rank, stride_c_row,
                      RANK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Axis 0 walks the anchors, so programs running together share the same rows of c in L2.
    anchor = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, RANK)
    row_mask = rows < n
    a = tl.load(a_ptr + anchor * stride_a_anchor + rows[:, None] * stride_a_row + ranks[None, :],
                mask=row_mask[:, None] & (ranks[None, :] < rank), other=0.0)
    l1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    l2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, features, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        col_mask = cols < features
        b = tl.load(b_ptr + anchor * stride_b_anchor + ranks[:, None] * stride_b_rank + cols[None, :],
                    mask=(ranks[:, None] < rank) & col_mask[None, :], other=0.0)
        mask = row_mask[:, None] & col_mask[None, :]
        c = tl.load(c_ptr + rows[:, None] * stride_c_row + cols[None, :], mask=mask, other=0.0)
        diff = tl.where(mask, tl.dot(a, b) - c.to(tl.float32), 0.0)  # fp32 accumulation
        l1 += tl.sum(tl.abs(diff), axis=1)
        l2 += tl.sum(diff * diff, axis=1)
    out = anchor * n + rows  # one program owns these entries: accumulate over layers in place
    tl.store(l1_ptr + out, tl.load(l1_ptr + out, mask=row_mask) + l1, mask=row_mask)
    tl.store(l2_ptr + out, tl.load(l2_ptr + out, mask=row_mask) + l2, mask=row_mask)


def low_rank_distances(current: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, summed over layers and features: (|A B - c|, (A B - c)^2), each [anchors, n] fp32.

    current [layers, >=n, D]; a [layers, anchors, >=n, r] and b [layers, anchors, r, D], each with
    a contiguous last dimension (anchors._low_rank_stack)."""
    layers, anchors, _, rank = a.shape
    features = b.shape[-1]
    l1 = torch.zeros(anchors, n, dtype=torch.float32, device=current.device)
    l2 = torch.zeros_like(l1)
    if n == 0:
        return l1, l2
    padded_rank = max(16, triton.next_power_of_2(rank))  # tl.dot needs >= 16 along K
    grid = (anchors, triton.cdiv(n, BLOCK_N))
    for layer in range(layers):
        rows = current[layer, :n]
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        a_layer, b_layer = a[layer], b[layer]
        _distances_kernel[grid](a_layer, b_layer, rows, l1, l2, n, features, rank,
                                a_layer.stride(0), a_layer.stride(1), b_layer.stride(0), b_layer.stride(1),
                                rows.stride(0), RANK=padded_rank, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    return l1, l2
