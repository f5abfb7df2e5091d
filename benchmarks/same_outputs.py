"""Before/after check of an optimisation: the share of turns whose output is token-identical
between two sweeps of the same workload (e.g. the same `kvbench sweep` command at two commits),
per method and cell. With greedy sampling at QPS 0 a change that only moves work around must give
100%; loaded cells batch differently from run to run, so they show the noise to compare with.

    .venv/bin/python benchmarks/same_outputs.py BEFORE_SWEEP AFTER_SWEEP
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from kvbench import run_files


def _outputs(run: Path) -> pd.Series:
    requests = pd.read_parquet(run / run_files.REQUESTS, columns=["trajectory_id", "turn_id", "success",
                                                                  "output_token_ids"])
    requests = requests[requests["success"]]
    return pd.Series([tuple(ids) for ids in requests["output_token_ids"]],
                     index=pd.MultiIndex.from_frame(requests[["trajectory_id", "turn_id"]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    rows = []
    for after in sorted((args.after / "runs").glob("*/*/" + run_files.REQUESTS)):
        cell = after.parent.relative_to(args.after / "runs")
        before = args.before / "runs" / cell
        if not (before / run_files.REQUESTS).exists():
            continue
        a, b = _outputs(before), _outputs(after.parent)
        common = a.index.intersection(b.index)
        same = sum(a[key] == b[key] for key in common)
        rows.append({"method": cell.parts[0], "cell": cell.parts[1], "turns": len(common),
                     "same output": f"{same / len(common):.0%}" if len(common) else "n/a"})
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
