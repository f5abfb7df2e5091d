"""Benchmark: what each method saves and what it costs, on the embedded model (issue 25).

For every method at each context, single stream (QPS 0): PGR over token F1 with its 95% interval
and its gain over FullShared (naive reuse), exact match and first-token KL of the reuse turns
against a NonShared reference, and p50 TTFT. Plus the noise floor: NonShared against the same
reference under load (--loaded-qps), where batching changes vLLM's numerics.

    .venv/bin/python benchmarks/bench_quality.py [--contexts 2048,8192] [--trajectories 6] \\
        [--methods ...] [--loaded-qps 1] [--result-dir DIR]

The runs are a `kvbench sweep --quality` (kept in --result-dir for `kvbench report` and
`kvbench leaderboard`, else a temporary folder). What the table shows (for instance whether a
correction recovers more than FullShared on this model) is a finding, not a target.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from contextlib import nullcontext
from pathlib import Path

from kvbench import run_files
from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep

METHODS = "nonshared,fullshared,kvcmas,kvcmas-nonchained,kvcomm,kvcomm-ref,graphflow,cacheblend,droidspeak,relaycaching"


def _fmt(value: object, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--trajectories", type=int, default=6)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--loaded-qps", type=float, default=1.0, help="NonShared's noise-floor cell")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    methods = [MethodConfig(m) for m in args.methods.split(",")]
    common = dict(num_trajectories=args.trajectories, num_warmups=2, prime_method_state=True,
                  output_len=args.output_len, seed=11, quality=True)
    # Every method single stream; NonShared alone under load (the noise floor), in a sweep of its own.
    single = SweepSpec(methods=methods, points=[SweepPoint(c, 0.0) for c in contexts], **common)  # type: ignore[arg-type]
    loaded = SweepSpec(methods=[MethodConfig("nonshared")], points=[SweepPoint(c, args.loaded_qps) for c in contexts],
                       **common)  # type: ignore[arg-type]
    with (nullcontext(str(args.result_dir)) if args.result_dir else tempfile.TemporaryDirectory()) as root:
        cells = run_sweep(single, Path(root) / "single") + run_sweep(loaded, Path(root) / "loaded")
        summaries = {(c.method.name, c.shared_tokens, c.qps): json.loads((c.path / run_files.SUMMARY).read_text())
                     for c in cells if (c.path / run_files.SUMMARY).exists()}
    print(f"{'method':<18} {'ctx':>5} {'qps':>4} {'PGR [95% CI]':>22} {'gain vs FullShared':>19} "
          f"{'exact (reuse)':>13} {'KL (reuse)':>10} {'p50 TTFT ms':>11} {'rho':>5}")
    for (name, context, qps), s in sorted(summaries.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        pgr = f"{_fmt(s.get('output_pgr'))} [{_fmt(s.get('output_pgr_low'))}, {_fmt(s.get('output_pgr_high'))}]"
        print(f"{name:<18} {context:>5} {qps:>4g} {pgr:>22} {_fmt(s.get('output_pgr_gain_over_naive')):>19} "
              f"{_fmt(s.get('exact_match_rate_reuse')):>13} {_fmt(s.get('mean_first_token_kl_reuse'), 4):>10} "
              f"{_fmt(s.get('p50_ttft_ms'), 0):>11} {_fmt(s.get('realized_rho'), 2):>5}")
    for context in contexts:
        loaded = summaries.get(("nonshared", context, args.loaded_qps))
        if loaded:
            print(f"noise floor at {context}, QPS {args.loaded_qps:g}: NonShared against its QPS-0 reference: exact "
                  f"match {_fmt(loaded.get('exact_match_rate'))}, token F1 {_fmt(loaded.get('mean_token_f1'))}, "
                  f"first-token KL {_fmt(loaded.get('mean_first_token_kl'), 5)}")
    keys = ("output_pgr", "output_pgr_low", "output_pgr_high", "output_pgr_gain_over_naive", "exact_match_rate_reuse",
            "mean_first_token_kl_reuse", "p50_ttft_ms", "realized_rho")
    print(json.dumps({f"{n}/{c}/{q:g}": {k: s.get(k) for k in keys} for (n, c, q), s in summaries.items()}))


if __name__ == "__main__":
    main()
