"""Soak: one method at a loaded QPS for a long, fixed time with a capped segment store. Memory
must plateau: prints the server's RSS, the segment store and the method's state (anchor pools,
references) over time, with failures and evictions, and whether RSS stopped growing.

    .venv/bin/python benchmarks/soak.py [--method kvcmas] [--minutes 30] [--qps 0.5]
        [--shared-tokens 2048] [--output-len 32] [--max-store-bytes 33554432] [--out DIR]

The run is a one-cell `kvbench sweep` with --prime-method-state after two warm-ups; its result
folder (requests.parquet, summary.json, server_metrics.jsonl with RSS at ~3 Hz, method_stats.jsonl
with the store and state bytes every 2 s) is kept in DIR/runs/<method>/, the printed table in
DIR/soak.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench import run_files
from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep

WARMUPS = 2
PLATEAU_GROWTH = 0.05  # RSS may grow at most this share over the run's second half


def _timeline(run: Path, slices: int) -> pd.DataFrame:
    """Per time slice of the measured run: peak RSS, store and method-state bytes, requests
    finished and failed by then, store evictions by then."""
    metrics = pd.DataFrame(run_files.read_jsonl(run / run_files.SERVER_METRICS))
    rss = metrics.dropna(subset=["process_tree_rss_bytes"])[["t_s", "process_tree_rss_bytes"]]
    states = run_files.read_jsonl(run / run_files.METHOD_STATS)
    state = pd.DataFrame([s for s in states if s["kind"] == "state"])
    state["method_state"] = state["method_state_bytes"].map(
        lambda d: sum(v for k, v in (d or {}).items() if not k.startswith("peak_")))
    requests = pd.read_parquet(run / run_files.REQUESTS)
    requests["end_s"] = requests["end_ns"] / 1e9
    # method_stats.jsonl's clock starts when the collector is made, a moment before the sampler's
    end = max(rss["t_s"].max(), state["t_s"].max())
    edges = np.linspace(0, end, slices + 1)
    rows = []
    for start, stop in zip(edges[:-1], edges[1:]):
        in_rss = rss[(rss["t_s"] >= start) & (rss["t_s"] < stop)]
        in_state = state[(state["t_s"] >= start) & (state["t_s"] < stop)]
        done = requests[requests["end_s"] < stop]
        rows.append({
            "minute": stop / 60,
            "peak_rss_mib": in_rss["process_tree_rss_bytes"].max() / 2**20 if len(in_rss) else math.nan,
            "store_mib": in_state["store_bytes"].max() / 2**20 if len(in_state) else math.nan,
            "method_state_mib": in_state["method_state"].max() / 2**20 if len(in_state) else math.nan,
            "finished": int(done["success"].sum()),
            "failed": int((~done["success"]).sum()),
            "evictions": int(in_state["store_evictions"].max()) if len(in_state) else 0,
        })
    return pd.DataFrame(rows)


def plateau(timeline: pd.DataFrame) -> dict[str, float | bool]:
    """RSS growth over the run's second half (last slice against the middle one) and the slope of
    a line fitted to the second half's slices."""
    rss = timeline["peak_rss_mib"].to_numpy()
    half = len(rss) // 2
    growth = float(rss[-1] / rss[half] - 1)
    slope = float(np.polyfit(timeline["minute"].to_numpy()[half:], rss[half:], 1)[0]) if len(rss) - half > 1 else 0.0
    return {"rss_growth_second_half": growth, "rss_slope_mib_per_min_second_half": slope,
            "plateau": bool(growth <= PLATEAU_GROWTH)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="kvcmas")
    parser.add_argument("--minutes", type=float, default=30.0, help="Length of the arrival schedule.")
    parser.add_argument("--qps", type=float, default=0.5, help="Trajectory arrivals per second (loaded, sustainable).")
    parser.add_argument("--shared-tokens", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-store-bytes", type=int, default=32 << 20)
    parser.add_argument("--slices", type=int, default=10)
    parser.add_argument("--model", default=None, help="[default: the embedded model]")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    args = parser.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    count = math.ceil(args.minutes * 60 * args.qps) + 1
    spec = SweepSpec(methods=[MethodConfig(args.method)], points=[SweepPoint(args.shared_tokens, args.qps, count)],
                     output_len=args.output_len, num_warmups=WARMUPS, prime_method_state=True, seed=11,
                     model=args.model, server_options={"max_store_bytes": args.max_store_bytes, "max_model_len": 8192})
    print(f"soak: {count} trajectories (+{WARMUPS} warm-ups) into {args.out}", flush=True)
    [cell] = run_sweep(spec, args.out)
    run = cell.path
    summary = json.loads((run / run_files.SUMMARY).read_text())
    timeline = _timeline(run, args.slices)
    verdict = plateau(timeline)
    lines = [
        f"# Soak: {args.method}, {args.shared_tokens} shared tokens, QPS {args.qps:g}, {args.minutes:g} min, "
        f"store cap {args.max_store_bytes / 2**20:.0f} MiB",
        "",
        f"Model {summary['model_id']}, commit {commit}, {platform.node()} ({platform.processor() or platform.machine()}), "
        f"{summary['config']['date']} UTC.",
        "",
        f"Requests: {summary['completed']} completed, {summary['failed']} failed over {summary['duration']:.0f} s; "
        f"p50 TTFT {summary['p50_ttft_ms']:.0f} ms, p90 {summary['p90_ttft_ms']:.0f} ms; "
        f"realized rho {summary['realized_rho']:.3f} (store-limited {summary['eligible_rho']:.3f}, "
        f"{summary['reuse_lost_to_eviction_share']:.1%} of reusable tokens lost to evictions); "
        f"store evictions {summary['store_evictions']}, store peak {summary['method_store_peak_bytes'] / 2**20:.1f} MiB, "
        f"peak server RSS {summary['peak_server_rss_bytes'] / 2**20:.0f} MiB.",
        "",
        timeline.to_markdown(index=False, floatfmt=(".1f", ".0f", ".1f", ".1f", ".0f", ".0f", ".0f")),
        "",
        f"RSS growth over the second half: {verdict['rss_growth_second_half']:+.1%} "
        f"(slope {verdict['rss_slope_mib_per_min_second_half']:+.2f} MiB/min); plateau (growth <= "
        f"{PLATEAU_GROWTH:.0%}): {'yes' if verdict['plateau'] else 'NO'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (args.out / "soak.md").write_text(text)
    (args.out / "soak.json").write_text(json.dumps({**verdict, "timeline": timeline.to_dict("records")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
