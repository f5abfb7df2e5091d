"""The context-free prefill's attention on the CPU (vLLM's kernel over a scratch paged cache)
against torch's causal SDPA on the same rows."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.core.forward import cpu_self_attention
from kvbench.methods.core.paged import CpuPackedLayout


def _layouts() -> list[CpuPackedLayout]:
    """The layouts vLLM's CPU backend picks on this machine for the embedded model's head size, at
    its default block size (128: vec, amx, neon...) and at a small one (16: vec16)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return [CpuPackedLayout(_get_attn_isa(torch.bfloat16, block_size, 32), block_size, 32, torch.bfloat16)
            for block_size in (128, 16)]


@pytest.mark.parametrize("layout", _layouts(), ids=lambda layout: f"{layout.isa}-{layout.block_size}")
@pytest.mark.parametrize("n", [1, 57, 300])  # one row; part of a block; several blocks, the last one partly filled
def test_kernel_self_attention_matches_causal_sdpa(layout: CpuPackedLayout, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    q_heads, kv_heads, hd = 8, 4, 32  # grouped-query, as the embedded model
    q = torch.randn(n, q_heads, hd, generator=g).bfloat16()
    k = torch.randn(n, kv_heads, hd, generator=g).bfloat16()
    v = torch.randn(n, kv_heads, hd, generator=g).bfloat16()
    scale = hd ** -0.5
    got = cpu_self_attention(q, k, v, scale, layout)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert got.shape == (n, q_heads, hd)
    # bf16 inputs and output: agreement to bf16 rounding, not beyond
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2), (got.float() - want).abs().max()
    # a row attends only to rows at or before it: changing the last row's K/V leaves the others alone
    if n > 1:
        k2, v2 = k.clone(), v.clone()
        k2[-1], v2[-1] = 10 * k2[-1], -v2[-1]
        again = cpu_self_attention(q, k2, v2, scale, layout)
        assert torch.equal(again[:-1], got[:-1]) and not torch.equal(again[-1], got[-1])
