"""Time KVCMAS's correction path alone at Llama-3.1-8B shapes, in torch, and compare the bytes it
must move with the device's copy bandwidth (issue 7's GPU check; runs on CPU at small shapes).

Per edge and shared segment of n tokens, the steps DeltaCorrection runs:
- value pass: distances of the source values to V anchors reconstructed from rank-r factors, all
  layers (the gate's Eq. 9 over k = n rows, and the token-wise value weights);
- key pass, token-wise weights and the two weighted sums of the V low-rank corrections;
- re-rotation of the keys: to canonical positions for matching, and the correction to the
  target positions (two constant-shift rotations in bf16);
- off the critical path (after the first token): one rank-r factorization, four per new anchor
  (the default for the model's width, and the full eigensolve for comparison).
Bandwidth is counted on the least bytes a step must move (its factors once, the cache rows read,
results written), for each path the distances can take here (CUDA: the fused Triton kernel and
the torch batched GEMMs). `--prefill` also times a dense prefill of the same n tokens through a
randomly initialized Llama-shaped model (HF transformers, no LM head: vLLM computes logits for
the last token only), which is what an accepted correction replaces.

    python benchmarks/gpu_correction_timing.py --device cuda --prefill -o timing.json   # 8K, 32K; L=32, D=1024
    python benchmarks/gpu_correction_timing.py --device cpu --tokens 512 --layers 4 --kv-heads 4 --head-dim 32
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbench.methods.core.rope import RopeAligner
from kvbench.methods.delta.anchors import (
    Anchor,
    anchor_distances,
    distance_paths,
    gate_from_distances,
    interpolated_delta,
)
from kvbench.methods.delta.stored import LowRank

EDGE = "A0->A1"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Mean seconds per call over `repeats` calls, after one warm-up call."""
    fn()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - started) / repeats


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 10)
    return 2 * nbytes / seconds


def synthetic_anchor(index: int, layers: int, n: int, d: int, rank: int, device: str,
                     generator: torch.Generator) -> Anchor:
    """An anchor with random rank-r factors made on the device: the timing depends on shapes only,
    and factorizing V full-size caches on the host would dominate the script's run time."""

    def factors() -> LowRank:
        a = torch.randn(layers, n, rank, generator=generator, device=device).to(torch.bfloat16)
        b = (torch.randn(layers, rank, d, generator=generator, device=device) / rank**0.5).to(torch.bfloat16)
        return LowRank.from_factors(a, b)

    anchor = Anchor(f"a{index}", "A0", factors(), factors())
    anchor.deltas[EDGE] = (factors(), factors())
    return anchor


def compared_paths(stored: list[LowRank], device: str) -> list[str]:
    """The distance path the method takes here, and on CUDA the torch path the fused kernel replaced."""
    default = distance_paths(stored, torch.device(device))[0]
    return [default, "batched"] if default == "fused" else [default]


def run(device: str, n: int, layers: int, heads: int, head_dim: int, rank: int, anchors: int,
        repeats: int) -> dict[str, Any]:
    d = heads * head_dim
    generator = torch.Generator(device=device).manual_seed(0)
    members = [synthetic_anchor(i, layers, n, d, rank, device, generator) for i in range(anchors)]
    # The source rows as the method sees them: the served cache's dtype (bf16).
    current_k = torch.randn(layers, n, d, generator=generator, device=device).to(torch.bfloat16)
    current_v = torch.randn(layers, n, d, generator=generator, device=device).to(torch.bfloat16)
    keys = current_k.view(layers, n, heads, head_dim)
    aligner = RopeAligner.from_theta(head_dim, 2 * n + 16, 500000.0).to(device)
    bases_v = [a.base_v for a in members]

    factor_bytes = sum(a.nbytes for a in members)  # base K, base V, delta K, delta V: a quarter each
    cache = layers * n * d * 2  # one of K or V in bf16
    # Least bytes each step must move: its factors once, the cache rows read, results written.
    minimal = {"gate": factor_bytes / 4 + cache, "delta": 3 * factor_bytes / 4 + cache + 2 * cache,
               "rotate": 4 * cache}
    result: dict[str, Any] = {"tokens": n, "factor_bytes": factor_bytes, "cache_bytes": 2 * cache}
    paths = compared_paths(bases_v, device)
    result["paths"] = paths
    for path in paths:
        def gate(path: str = path) -> None:
            gate_from_distances(anchor_distances(current_v, bases_v, n, gate_rows=n, path=path)[1], 0.3)

        value_distances, _ = anchor_distances(current_v, bases_v, n, gate_rows=n, path=path)

        def delta(path: str = path, value_distances: torch.Tensor = value_distances) -> None:
            interpolated_delta(current_k, current_v, members, EDGE, n, value_distances=value_distances, path=path)

        times = {"gate": timed(gate, device, repeats), "delta": timed(delta, device, repeats)}
        for step, seconds in times.items():
            result[f"{step}_{path}_ms"] = 1e3 * seconds
            result[f"{step}_{path}_GBs"] = minimal[step] / seconds / 1e9
    rotate_s = timed(lambda: (aligner.rotate(keys, -n // 2, exact=False), aligner.rotate(keys, n // 2, exact=False)),
                     device, repeats)
    result["rotate_ms"], result["rotate_GBs"] = 1e3 * rotate_s, minimal["rotate"] / rotate_s / 1e9
    default = paths[0]
    result["correction_ms"] = result[f"gate_{default}_ms"] + result[f"delta_{default}_ms"] + result["rotate_ms"]
    # A dense fallback's deferred work: four of these per new anchor (base K, V, delta K, V).
    dense = torch.randn(layers, n, d, generator=generator, device=device).to(torch.bfloat16)
    result["factorize_ms"] = 1e3 * timed(lambda: LowRank(dense, rank, torch.bfloat16), device, max(1, repeats // 2))
    # The full eigensolve, for comparison (the default below EXACT_EIGH_MAX_FEATURES features).
    result["factorize_exact_ms"] = 1e3 * timed(lambda: LowRank(dense, rank, torch.bfloat16, exact=True), device, 1)
    return result


def prefill_seconds(device: str, n: int, layers: int, kv_heads: int, head_dim: int, repeats: int) -> float:
    """Seconds for one dense prefill of n tokens through a random Llama-3.1-8B-shaped model
    (32 query heads per 8 KV heads, MLP 3.5x hidden), without the LM head."""
    from transformers import LlamaConfig, LlamaModel

    heads = 4 * kv_heads
    hidden = heads * head_dim
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(3.5 * hidden), num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         vocab_size=32000, max_position_embeddings=n + 16, rope_theta=500000.0)
    config._attn_implementation = "sdpa"
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaModel(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    ids = torch.randint(0, config.vocab_size, (1, n), device=device)
    with torch.inference_mode():
        return timed(lambda: model(input_ids=ids, use_cache=False), device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="8192,32768", help="segment lengths, comma-separated")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--anchors", type=int, default=10, help="V")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill", action="store_true", help="also time a dense prefill of each segment")
    parser.add_argument("-o", "--output", help="write the results as JSON here")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    bandwidth = copy_bandwidth(args.device, 1 << (32 if args.device.startswith("cuda") else 26))
    print(f"device={args.device} copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write)")
    print(f"L={args.layers} D={args.kv_heads * args.head_dim} r={args.rank} V={args.anchors}")
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        r = run(args.device, n, args.layers, args.kv_heads, args.head_dim, args.rank, args.anchors, args.repeats)
        rows.append(r)
        paths = r["paths"]
        print(f"n={n}: correction {r['correction_ms']:.2f} ms = gate {r[f'gate_{paths[0]}_ms']:.2f} + weights+delta "
              f"{r[f'delta_{paths[0]}_ms']:.2f} + re-rotation {r['rotate_ms']:.2f} ({paths[0]} distances); "
              f"deferred factorization {r['factorize_ms']:.1f} ms each (4 per new anchor; full eigensolve "
              f"{r['factorize_exact_ms']:.1f} ms)", flush=True)
        for step in ("gate", "delta"):
            print(f"  {step}: " + ", ".join(
                f"{path} {r[f'{step}_{path}_ms']:.2f} ms, {r[f'{step}_{path}_GBs']:.0f} GB/s "
                f"({r[f'{step}_{path}_GBs'] * 1e9 / bandwidth:.3f} of copy bandwidth)" for path in paths))
        print(f"  rotate: {r['rotate_ms']:.2f} ms, {r['rotate_GBs']:.0f} GB/s "
              f"({r['rotate_GBs'] * 1e9 / bandwidth:.3f} of copy bandwidth)")
        if args.prefill:  # last, so that a failure here loses none of the figures above
            try:
                r["prefill_ms"] = 1e3 * prefill_seconds(args.device, n, args.layers, args.kv_heads, args.head_dim,
                                                        max(1, args.repeats // 2))
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()  # the model's weights, before the next segment length
                print(f"  dense prefill of the {n} tokens: {r['prefill_ms']:.1f} ms "
                      f"(correction = {r['correction_ms'] / r['prefill_ms']:.3f} of it)", flush=True)
            except Exception as error:  # noqa: BLE001 - report and keep the correction figures
                r["prefill_error"] = f"{type(error).__name__}: {error}"
                print(f"  dense prefill failed: {r['prefill_error']}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": args.device, "copy_GBs": bandwidth / 1e9, "layers": args.layers,
                       "kv_heads": args.kv_heads, "head_dim": args.head_dim, "rank": args.rank,
                       "anchors": args.anchors, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
