"""Benchmark: PolyKV's compressed shared pool inside vLLM against FullShared's bf16 store (issue 26).

At each context, single stream (QPS 0), on the embedded model: bytes the segment store held per
stored token (measured from the tensors kept) for FullShared and each PolyKV variant, and the
ratio (target: at least 2.5x fewer for the bit-packed default); p50 TTFT against FullShared's
(decompression on the load path); compression and decompression time per 1K tokens; and what the
compression costs in outputs: PGR and first-token KL against NonShared. With `--with-correction`,
also KVCMAS with a compressed segment store and KVComm with compressed store and anchor bases
(`base_codec`), beside both uncompressed: what compression and correction give together (their
anchor-pool MiB in the last column).

    .venv/bin/python benchmarks/bench_polykv.py [--contexts 2048,8192] [--trajectories 4] [--with-correction]
        [--result-dir DIR]

The runs are a `kvbench sweep --quality` (kept in --result-dir for `kvbench report`).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from contextlib import nullcontext
from pathlib import Path

from kvbench import run_files
from kvbench.analysis.runs import find_runs
from kvbench.experiment.sweep import MethodConfig, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep

VARIANTS = ("polykv", "polykv-published", "polykv-channel-packed", "polykv-token-packed-fp16norm")


def _fmt(value: object, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--with-correction", action="store_true",
                        help="also KVCMAS and KVComm with and without compression")
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args()
    methods = [MethodConfig("nonshared"), MethodConfig("fullshared")]
    methods += [MethodConfig("polykv", {"store_codec": v}, label=v) for v in VARIANTS]
    if args.with_correction:
        methods += [MethodConfig("kvcmas"), MethodConfig("kvcmas", {"store_codec": "polykv"}, label="kvcmas+polykv"),
                    MethodConfig("kvcomm"),
                    MethodConfig("kvcomm", {"store_codec": "polykv", "base_codec": "polykv"}, label="kvcomm+polykv")]
    spec = SweepSpec(methods=methods, shared_tokens=[int(c) for c in args.contexts.split(",")], qps=[0.0],
                     num_trajectories=args.trajectories, num_warmups=1, output_len=args.output_len, seed=13,
                     quality=True)
    with (nullcontext(str(args.result_dir)) if args.result_dir else tempfile.TemporaryDirectory()) as root:
        cells = run_sweep(spec, Path(root))
        summaries, pools = {}, {}
        for cell in cells:
            if (cell.path / run_files.SUMMARY).exists():
                run = find_runs([cell.path])[0]
                summaries[(cell.method.name, cell.shared_tokens)] = run.summary
                # the method's own state (anchor pools), apart from the segment store
                memory = run.memory()
                pools[(cell.method.name, cell.shared_tokens)] = memory["method_state_mib"] - memory["store_peak_mib"]
    print(f"{'method':<30} {'ctx':>5} {'bytes/token':>11} {'vs FullShared':>13} {'p50 TTFT ms':>11} "
          f"{'vs FullShared':>13} {'enc ms/1K':>9} {'dec ms/1K':>9} {'PGR':>6} {'KL (reuse)':>10} {'rho':>5} "
          f"{'pool MiB':>8}")
    for (name, context), s in sorted(summaries.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        full = summaries.get(("fullshared", context), {})
        size, full_size = s.get("store_bytes_per_token"), full.get("store_bytes_per_token")
        ttft, full_ttft = s.get("p50_ttft_ms"), full.get("p50_ttft_ms")
        print(f"{name:<30} {context:>5} {_fmt(size, 0):>11} "
              f"{_fmt(full_size / size if size and full_size else None, 2):>13} {_fmt(ttft, 0):>11} "
              f"{_fmt(ttft / full_ttft if ttft and full_ttft else None, 2):>13} "
              f"{_fmt(s.get('store_encode_ms_per_1k_tokens'), 2):>9} {_fmt(s.get('store_decode_ms_per_1k_tokens'), 2):>9} "
              f"{_fmt(s.get('output_pgr')):>6} {_fmt(s.get('mean_first_token_kl_reuse'), 4):>10} "
              f"{_fmt(s.get('realized_rho'), 2):>5} {_fmt(pools[(name, context)], 1):>8}")
    print(json.dumps({f"{n}/{c}": {k: s.get(k) for k in ("store_bytes_per_token", "p50_ttft_ms", "output_pgr", "output_pgr_low",
                                                          "output_pgr_high", "mean_first_token_kl_reuse",
                                                          "store_encode_ms_per_1k_tokens",
                                                          "store_decode_ms_per_1k_tokens", "realized_rho")}
                      | {"pool_mib": pools[(n, c)]} for (n, c), s in summaries.items()}))


if __name__ == "__main__":
    main()
