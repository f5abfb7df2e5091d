"""Benchmark: the method x deviation matrix (issue 35). Every method on every role-family model
(kvbench:roles-transferable, -sparse, -deep, -content-bound: constructed test models whose shared
caches depend on the reading agent, docs/models.md), on `gen-trace --task role-recall`, at each
context single stream and at one loaded QPS: task accuracy on reuse turns with its 95% interval,
its gain over FullShared (exact McNemar p-value), realized rho, recompute share, p50 TTFT; the
task metric's noise floor (NonShared under load against NonShared at QPS 0); a heatmap.

    .venv/bin/python benchmarks/bench_deviation_matrix.py --result-dir DIR \\
        [--families transferable,sparse,deep,content-bound] [--methods ...] [--contexts 2048,8192] \\
        [--loaded-qps 0.5] [--trajectories 24] [--warmups 3]

One `kvbench sweep` per family under DIR/sweeps/ (rerun the same command to resume: finished
cells are kept), then DIR/matrix.{md,csv,json,png}; `kvbench leaderboard DIR/sweeps/*` ranks the
same runs. Methods run with their default parameters after `--warmups` priming trajectories: what
a method recovers where its assumption holds, and where it does not, is the finding; nothing here
is tuned to it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvbench.analysis.deviation import METHOD_ORDER, write_matrix
from kvbench.analysis.runs import find_runs
from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep
from kvbench.model.roles import PROMPT_FAMILIES as FAMILIES
from kvbench.tracegen.tasks.recall import recall_output_len
from kvbench.tracegen.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", type=Path, required=True)
    parser.add_argument("--families", default=",".join(f.removeprefix("roles-") for f in FAMILIES))
    parser.add_argument("--methods", default=",".join(METHOD_ORDER))
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--loaded-qps", type=float, default=0.5)
    parser.add_argument("--trajectories", type=int, default=24)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--seed", type=int, default=35)
    args = parser.parse_args()
    families = [f"roles-{f.removeprefix('roles-')}" for f in args.families.split(",")]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    points = [SweepPoint(c, q) for c in contexts for q in (0.0, args.loaded_qps)]
    for family in families:
        model = f"kvbench:{family}"
        spec = SweepSpec(methods=[MethodConfig(m) for m in args.methods.split(",")], points=points,
                         task="role-recall", output_len=recall_output_len(load_tokenizer(model).encode),
                         num_trajectories=args.trajectories, num_warmups=args.warmups, prime_method_state=True,
                         seed=args.seed, model=model)
        started = time.monotonic()
        run_sweep(spec, args.result_dir / "sweeps" / family,
                  on_cell=lambda name, family=family: print(f"[{time.strftime('%H:%M:%S')}] {family}: {name}",
                                                            flush=True))
        print(f"{family}: done in {(time.monotonic() - started) / 60:.1f} min", flush=True)
    paths = write_matrix(find_runs([args.result_dir / "sweeps"]), args.result_dir)
    print(paths["markdown"].read_text())
    print("written: " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
