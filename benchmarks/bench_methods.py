"""Benchmark: NonShared vs FullShared inside vLLM, four agents, QPS 0, at 2K and 8K shared tokens.

Prints, per context: p50 TTFT of the reuse turns (A1-A3) per method and their ratio (target:
FullShared >= 3x lower at 8K), the connector's materialization time per 1K reused tokens, and
the cost of saving a request's cache relative to that request's E2E (target < 10%).

    .venv/bin/python benchmarks/bench_methods.py [--contexts 2048,8192] [--trajectories 4] [--result-dir DIR]

The runs are a `kvbench sweep` (kept in --result-dir for `kvbench report`, else a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import nullcontext
from pathlib import Path

import pandas as pd

from kvbench import run_files
from kvbench.experiment.sweep import MethodConfig, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep

METHODS = ("nonshared", "fullshared")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    spec = SweepSpec(methods=[MethodConfig(m) for m in METHODS], shared_tokens=contexts, qps=[0.0],
                     num_trajectories=args.trajectories, num_warmups=1, seed=7)
    with (nullcontext(str(args.result_dir)) if args.result_dir else tempfile.TemporaryDirectory()) as root:
        cells = run_sweep(spec, Path(root))
        results = {(c.method.method, c.shared_tokens): pd.read_parquet(c.path / run_files.REQUESTS) for c in cells}
    print(f"{'context':>8} {'nonshared p50 TTFT ms':>22} {'fullshared p50 TTFT ms':>23} {'ratio':>6} "
          f"{'materialize ms/1K reused':>25} {'save / E2E':>11} {'failed':>7}")
    for context in contexts:
        dense, shared = results[("nonshared", context)], results[("fullshared", context)]
        reuse_turn = lambda df: df[df["turn_id"] != "A0.r0"]  # noqa: E731
        p50_dense = reuse_turn(dense)["ttft_ms"].median()
        p50_shared = reuse_turn(shared)["ttft_ms"].median()
        stats = reuse_turn(shared)["method_stats"].map(json.loads)
        per_1k = (stats.map(lambda s: s["materialize_s"]) * 1e3 / (stats.map(lambda s: s["reused_tokens"]) / 1e3)).median()
        all_stats = shared["method_stats"].map(lambda s: json.loads(s) if s else {})
        save_share = (all_stats.map(lambda s: s.get("save_s", float("nan"))) * 1e3 / shared["e2el_ms"]).median()
        failed = int((~dense["success"]).sum() + (~shared["success"]).sum())
        print(f"{context:>8} {p50_dense:>22.1f} {p50_shared:>23.1f} {p50_dense / p50_shared:>5.1f}x "
              f"{per_1k:>25.2f} {save_share:>10.1%} {failed:>7}")


if __name__ == "__main__":
    main()
