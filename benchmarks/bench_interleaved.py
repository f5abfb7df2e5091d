"""Benchmark: does a comparison hold up on a busy machine? (issue 65, item 8)

Runs `kvbench quickstart` (NonShared, FullShared, KVCMAS on the default constructed model, 8K, QPS 0)
into a fresh folder, on a quiet machine or with `--busy-cores N` processes spinning beside it, and
prints what the report reads from it:
- first turns (they reuse nothing: every method must equal NonShared there) FullShared / NonShared
  and KVCMAS / NonShared p50 TTFT, with 95% intervals over trajectories: they should hold 1;
- reuse turns KVCMAS / NonShared (below 1, its interval too) and the A/A arm's ratio (NonShared
  against itself: the noise floor), where the quickstart has one;
- the share of the cores other processes used while each run ran (the busy loop shows there).

`--kvbench PATH` runs another checkout's `kvbench` (e.g. the commit before interleaving, whose
quickstart runs the methods one after another): the same figures, read by this checkout's analysis.

    .venv/bin/python benchmarks/bench_interleaved.py --out DIR [--busy-cores 1] [--kvbench PATH]
        [--num-trajectories 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvbench.analysis.runs import find_runs
from kvbench.analysis.savings import reuse_turn_savings

SPIN = "while True: pass"


def figures(out: Path) -> dict[str, Any]:
    runs = [run for run in find_runs([out]) if not run.is_floor]
    table = reuse_turn_savings(runs).set_index("run")
    by_method = {name.split()[0]: row for name, row in table.iterrows()}
    result: dict[str, Any] = {"others_cpu_share": {run.name: run.summary.get("others_cpu_share") for run in runs},
                              "interleaved": any(run.interleaved for run in runs)}
    for method, row in by_method.items():
        result[method] = {"first_vs_nonshared": row["first_vs_nonshared"], "reuse_vs_nonshared": row["reuse_vs_nonshared"],
                          "reuse_finding": row["reuse_finding"], "first_finding": row["first_finding"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a folder of its own (the quickstart writes into it)")
    parser.add_argument("--busy-cores", type=int, default=0, help="processes spinning beside the quickstart")
    parser.add_argument("--kvbench", default=str(Path(sys.executable).parent / "kvbench"))
    parser.add_argument("--num-trajectories", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy_cores)]
    started = time.time()
    try:
        subprocess.run([args.kvbench, "quickstart", "--out", str(args.out), "--num-trajectories",
                        str(args.num_trajectories)], check=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    result = {"busy_cores": args.busy_cores, "kvbench": args.kvbench, "wall_s": round(time.time() - started, 1),
              **figures(args.out)}
    print(json.dumps(result, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
