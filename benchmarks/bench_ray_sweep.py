"""Benchmark: what running a sweep's cells as Ray tasks adds to each cell (issue 54, item 4).

The same small sweep (real vLLM cells on the embedded model) run locally (`run_sweep`) and on a
local Ray started for it (`run_sweep_on_ray`, as `kvbench sweep --ray`), `--repeats` times each,
alternating which goes first. Prints:
- wall time per sweep on each side, and Ray's extra per run (the difference over the runs), with
  its spread over the repeats;
- Ray's own parts per run from ray_cells.jsonl: task start (submission to the task's start on its
  worker, the first task of each sweep: nothing to wait for), placing the inputs, sending a
  finished run folder back (and its bytes), committing it.
On one machine both sides run their cells one after another (a CPU cell asks for all cores).

    .venv/bin/python benchmarks/bench_ray_sweep.py [--repeats 3] [--methods nonshared,fullshared]
        [--shared-tokens 1024] [--trajectories 2] [--output-len 16] [--result-dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.experiment.ray_sweep import RAY_CELLS_FILE, RayOptions, run_sweep_on_ray
from kvbench.experiment.sweep import MethodConfig, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep
from kvbench.replay.run_config import git_sha


def _spread(values: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=float)
    return {"median": float(np.median(array)), "min": float(array.min()), "max": float(array.max()), "n": len(array)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="nonshared,fullshared")
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--trajectories", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--result-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = args.result_dir or Path(tempfile.mkdtemp(prefix="bench-ray-"))
    spec = SweepSpec(methods=[MethodConfig(m) for m in args.methods.split(",")], shared_tokens=[args.shared_tokens],
                     qps=[0.0], num_trajectories=args.trajectories, output_len=args.output_len)
    runs = len(spec.cells(root))
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    records: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for side in (("local", "ray") if repeat % 2 == 0 else ("ray", "local")):
            out = root / f"{side}-{repeat}"
            began = time.monotonic()
            if side == "local":
                run_sweep(spec, out)
            else:
                run_sweep_on_ray(spec, out, RayOptions(), on_line=lambda line: print(f"  [ray] {line}", flush=True))
                lines = [json.loads(line) for line in (out / RAY_CELLS_FILE).read_text().splitlines()]
                first = min(lines, key=lambda r: r["task_start_s"])
                records += [{**r, "first_task": r is first} for r in lines]
            walls[side].append(time.monotonic() - began)
            print(f"repeat {repeat} {side}: {walls[side][-1]:.1f} s for {runs} runs", flush=True)
    extra_per_run = [(ray - local) / runs for ray, local in zip(walls["ray"], walls["local"])]
    figures = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "commit": git_sha(), "model": "kvbench:recall-v1",
        "enforce_eager": os.environ.get("KVBENCH_ENFORCE_EAGER") == "1", "runs_per_sweep": runs,
        "wall_s": {side: _spread(values) for side, values in walls.items()},
        "ray_extra_per_run_s": _spread(extra_per_run),
        "task_start_first_s": _spread([r["task_start_s"] for r in records if r["first_task"]]),
        "inputs_s": _spread([r["inputs_s"] for r in records]),
        "transfer_s": _spread([r["transfer_s"] for r in records]),
        "commit_s": _spread([r["commit_s"] for r in records]),
        "bytes_per_run": _spread([r["bytes"] for r in records]),
        "run_s": _spread([r["run_s"] for r in records]),
    }
    print(f"\nwall per sweep ({runs} runs): local {figures['wall_s']['local']['median']:.1f} s, "
          f"Ray {figures['wall_s']['ray']['median']:.1f} s (medians of {args.repeats})")
    extra = figures["ray_extra_per_run_s"]
    print(f"Ray's extra per run: {extra['median']:.2f} s [{extra['min']:.2f}, {extra['max']:.2f}] (median [min, max])")
    for key in ("task_start_first_s", "inputs_s", "transfer_s", "commit_s", "run_s"):
        f = figures[key]
        print(f"  {key}: {f['median']:.3f} s [{f['min']:.3f}, {f['max']:.3f}] over {f['n']}")
    print(f"  bytes per run: {figures['bytes_per_run']['median'] / 1e6:.2f} MB")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
