"""Benchmark: turns that reuse nothing cost what they cost under NonShared (issue 36, item 0).

Replays a fan-in trace (its leaves read no earlier turn's cache) and a two-round loop trace
(whose second round vLLM's own prefix cache serves) under NonShared and connector methods, QPS 0,
and prints per method:
- p50 TTFT of the turns that reuse nothing (`reusable_tokens == 0`) and its ratio to the same
  turns under NonShared (target <= 1.1x), and the share of them the connector claimed;
- the share of those turns whose output is token-identical to NonShared's (with exact inputs the
  answer must be NonShared's);
- on the loop trace, the p50 TTFT of the second round's turns and the rows vLLM's prefix cache
  served them.

    .venv/bin/python benchmarks/bench_unclaimed_turns.py [--methods fullshared,kvcmas] [--trajectories 4]
        [--result-dir DIR]

The runs are `kvbench sweep`s (kept in --result-dir for `kvbench report`, else a temporary folder).
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

TRACES = {  # name -> the sweep's workload
    "fan-in 6 agents, 4K": dict(workflow="fan-in", agents=[6], rounds=[1], shared_tokens=[4096], seed=90210),
    "loop 4 agents x 2 rounds, 2K": dict(workflow="loop", agents=[4], rounds=[2], shared_tokens=[2048], seed=7),
}


def _claimed(stats: str | None) -> bool:
    return bool(stats) and bool(json.loads(stats).get("claimed", True))


def report(name: str, runs: dict[str, pd.DataFrame]) -> None:
    dense = runs["nonshared"].set_index(["trajectory_id", "turn_id"])
    print(f"\n{name}")
    print(f"{'method':>18} {'turns':>6} {'p50 TTFT ms':>12} {'vs NonShared':>13} {'claimed':>8} {'same output':>12} "
          f"{'round-2 p50 ms':>15} {'round-2 prefix hit':>19} {'failed':>7}")
    for method, requests in runs.items():
        requests = requests.set_index(["trajectory_id", "turn_id"])
        unreused = requests[requests["reusable_tokens"] == 0]
        reference = dense.loc[unreused.index]
        ratio = unreused["ttft_ms"].median() / reference["ttft_ms"].median()
        same = sum(list(a) == list(b) for a, b in zip(unreused["output_token_ids"], reference["output_token_ids"]))
        claimed = unreused["method_stats"].map(_claimed).mean() if method != "nonshared" else 0.0
        later = requests[requests.index.get_level_values("turn_id").str.endswith(".r1")]
        later_p50 = later["ttft_ms"].median() if len(later) else float("nan")
        later_hit = (later["prefix_cached_tokens"].fillna(0) / later["prompt_tokens"]).mean() if len(later) else float("nan")
        print(f"{method:>18} {len(unreused):>6} {unreused['ttft_ms'].median():>12.1f} {ratio:>12.2f}x {claimed:>8.0%} "
              f"{same / max(1, len(unreused)):>12.0%} {later_p50:>15.1f} {later_hit:>19.0%} "
              f"{int((~requests['success']).sum()):>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="fullshared,kvcmas", help="connector methods beside NonShared")
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args()
    methods = ["nonshared", *args.methods.split(",")]
    with (nullcontext(str(args.result_dir)) if args.result_dir else tempfile.TemporaryDirectory()) as root:
        for index, (name, workload) in enumerate(TRACES.items()):
            spec = SweepSpec(methods=[MethodConfig(m) for m in methods], qps=[0.0], num_trajectories=args.trajectories,
                             num_warmups=1, output_len=args.output_len, **workload)  # type: ignore[arg-type]
            cells = run_sweep(spec, Path(root) / f"trace{index}")
            report(name, {c.method.method: pd.read_parquet(c.path / run_files.REQUESTS) for c in cells})


if __name__ == "__main__":
    main()
