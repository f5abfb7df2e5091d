"""Time KVCMAS's correction path alone at Llama-3.1-8B shapes, in torch, and compare the bytes it
must move with the device's copy bandwidth (issue 7's GPU check; runs on CPU at small shapes).

Per edge and shared segment of n tokens: the value pass (distances to V anchors reconstructed
from rank-r factors, all layers: the gate's Eq. 9 over k = n rows and the token-wise value
weights), then the key pass, the weighted sums of the V low-rank corrections, and re-rotation of
the source keys to the target positions.

    python benchmarks/gpu_correction_timing.py --device cuda            # 8K and 32K, L=32, D=1024
    python benchmarks/gpu_correction_timing.py --device cpu --tokens 512 --layers 4 --kv-heads 4 --head-dim 32
"""

from __future__ import annotations

import argparse
import time

import torch

from kvbench.methods.anchors import AnchorPool, anchor_distances, gate_from_distances, interpolated_delta
from kvbench.methods.rope import RopeAligner


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - started) / repeats


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 10)
    return 2 * nbytes / seconds  # read + write


def run(device: str, n: int, layers: int, heads: int, head_dim: int, rank: int, anchors: int, repeats: int) -> dict:
    d = heads * head_dim
    g = torch.Generator(device="cpu").manual_seed(0)
    pool = AnchorPool(anchors)
    for index in range(anchors):  # anchors from distinct contents, built on the CPU, then moved
        base = torch.randn(layers, n, d, generator=g)
        pool.add(f"a{index}", "A0->A1", base, base, 0.1 * base, 0.1 * base, rank, rank, torch.bfloat16)
    for anchor in pool.anchors.values():
        for stored in (anchor.base_k, anchor.base_v, *anchor.deltas["A0->A1"]):
            stored.a, stored.b = stored.a.to(device), stored.b.to(device)
    members = list(pool.anchors.values())
    # The source rows as the method sees them: the served cache's dtype (bf16).
    current_k = torch.randn(layers, n, d, generator=g).to(device, torch.bfloat16)
    current_v = torch.randn(layers, n, d, generator=g).to(device, torch.bfloat16)
    keys = current_k.view(layers, n, heads, head_dim)
    aligner = RopeAligner.from_theta(head_dim, 2 * n + 16, 500000.0).to(device)

    # The path DeltaCorrection runs: one pass over the value states gives the gate's distances
    # (Eq. 9) and the token-wise value weights; on accept, the key pass and the weighted sums.
    bases_v = [a.base_v for a in members]
    gate_s = timed(lambda: gate_from_distances(anchor_distances(current_v, bases_v, n, gate_rows=n)[1], 0.3),
                   device, repeats)
    value_distances, _ = anchor_distances(current_v, bases_v, n, gate_rows=n)
    delta_s = timed(lambda: interpolated_delta(current_k, current_v, members, "A0->A1", n,
                                               value_distances=value_distances), device, repeats)
    # Keys to canonical positions for matching, and the correction to the target positions: two
    # constant-shift rotations in bf16 (DeltaCorrection._source_rows and correct).
    rotate_s = timed(lambda: (aligner.rotate(keys, -n // 2, exact=False), aligner.rotate(keys, n // 2, exact=False)),
                     device, repeats)
    factors = sum(a.nbytes for a in members)  # base K, base V, delta K, delta V: a quarter each
    cache = layers * n * d * 2  # one of K or V in bf16
    # Bytes each step must move at least: its factors once, the current cache read, results written.
    minimal = {"gate": factors / 4 + cache, "weights+delta": 3 * factors / 4 + cache + 2 * cache,
               "rotate": 4 * cache}
    return {"n": n, "gate_ms": 1e3 * gate_s, "weights_delta_ms": 1e3 * delta_s, "rotate_ms": 1e3 * rotate_s,
            "gate_GBs": minimal["gate"] / gate_s / 1e9, "delta_GBs": minimal["weights+delta"] / delta_s / 1e9,
            "rotate_GBs": minimal["rotate"] / rotate_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--anchors", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bandwidth = copy_bandwidth(args.device, 1 << (30 if args.device.startswith("cuda") else 26))
    print(f"device={args.device} copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write)")
    for n in (int(t) for t in args.tokens.split(",")):
        r = run(args.device, n, args.layers, args.kv_heads, args.head_dim, args.rank, args.anchors, args.repeats)
        print(f"n={n}: gate {r['gate_ms']:.2f} ms ({r['gate_GBs']:.1f} GB/s), weights+delta {r['weights_delta_ms']:.2f} ms "
              f"({r['delta_GBs']:.1f} GB/s), re-rotation {r['rotate_ms']:.2f} ms ({r['rotate_GBs']:.1f} GB/s); "
              f"fractions of copy bandwidth {r['gate_GBs'] * 1e9 / bandwidth:.2f} / {r['delta_GBs'] * 1e9 / bandwidth:.2f}"
              f" / {r['rotate_GBs'] * 1e9 / bandwidth:.2f}")


if __name__ == "__main__":
    main()
