"""Benchmark: causal self-attention of n rows on the CPU, torch's SDPA against vLLM's CPU kernel
over a scratch paged cache (`kvbench.methods.core.forward.cpu_self_attention`, the context-free
reference prefill's attention). Prints ms per call of each and their ratio.

    .venv/bin/python benchmarks/bench_self_attention.py [--tokens 2048,8192] [--q-heads 8] [--kv-heads 4]
        [--head-dim 32] [--block-size 128] [--repeats 3]

The defaults are the embedded model's shapes and vLLM's CPU block size.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvbench.methods.core.forward import cpu_self_attention
from kvbench.methods.core.paged import CpuPackedLayout


def ms_per_call(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call allocations and kernel dispatch
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--q-heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    isa = _get_attn_isa(torch.bfloat16, args.block_size, args.head_dim)  # the one vLLM picks on this CPU
    layout = CpuPackedLayout(isa, args.block_size, args.head_dim, torch.bfloat16)
    scale = args.head_dim ** -0.5
    print(f"isa={isa} threads={torch.get_num_threads()} heads={args.q_heads}/{args.kv_heads}x{args.head_dim}")
    for n in (int(t) for t in args.tokens.split(",")):
        g = torch.Generator().manual_seed(n)
        q = torch.randn(n, args.q_heads, args.head_dim, generator=g).bfloat16()
        k = torch.randn(n, args.kv_heads, args.head_dim, generator=g).bfloat16()
        v = torch.randn(n, args.kv_heads, args.head_dim, generator=g).bfloat16()
        sdpa = ms_per_call(lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale,
            enable_gqa=args.q_heads != args.kv_heads), args.repeats)
        kernel = ms_per_call(lambda q=q, k=k, v=v: cpu_self_attention(q, k, v, scale, layout), args.repeats)
        print(f"n={n}: sdpa {sdpa:.3f} ms, kernel {kernel:.3f} ms, sdpa/kernel {sdpa / kernel:.2f}x")


if __name__ == "__main__":
    main()
