"""Benchmark: one vLLM instance against two sharing caches through Mooncake Store (issue 53, item 6).

For each method (FullShared: the transfer itself; KVCMAS: a corrected method, whose anchor pools
the instances share through the tier, issue 68) it starts one instance on every core, two instances
on half the cores each with a shared tier (a mooncake_master started here), for FullShared two
without one, and for KVCMAS two whose anchor pools stay per instance (`anchor_sharing=instance`). Each is warmed
up by two unmeasured runs (its first and last routing); then a role-recall trace on
`kvbench:roles-transferable` is replayed per context, at QPS 0 and a loaded QPS, under each routing
policy, after `--warmups` warm-up trajectories per instance of the two-instance setup in every
setup (KVCMAS's anchor pools are per instance: each learns from the warm-ups routed to it; one
instance learns from all of them), so every setup measures the same trajectories. Prints and writes per run: realized rho,
p50/p90 TTFT (all turns, and the turns reading an earlier agent's output), workflow throughput,
reuse-turn accuracy, the shared tier's hits, misses, bytes per reused token, p50/p90 remote get,
puts, and the store's memory; and per context:
- a load served from the shared tier against a local one: p50 `load_ms` of the reuse turns that
  fetched a source (agent and round-robin routing) over those that read theirs locally (trajectory
  and cache-aware), on the same two instances, with a 95% bootstrap interval over trajectories
  (target at 8K: <= 1.5);
- FullShared's outputs under each routing on two instances against one instance (token identity);
- the bytes a shared tier holds (one copy of each source) against every instance keeping its own
  copy of every source (N copies);
- KVCMAS's reuse-turn accuracy, realized rho and reuse-turn p50 TTFT on one instance and on two
  (shared and per-instance pools) under agent routing, the two-instance p50 over the one-instance
  p50 with a 95% bootstrap interval, and the tier's bytes for anchors beside those for caches.

    .venv/bin/python benchmarks/bench_instances.py [--contexts 2048,8192] [--trajectories 6]
        [--warmups 2] [--output-len N] [--loaded-qps 2048:1,8192:0.25] [--methods fullshared,kvcmas]
        [--result-dir DIR] [--json FILE]
    .venv/bin/python benchmarks/bench_instances.py --reanalyze FILE... --json FILE
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis.intervals import p50_ratio_interval
from kvbench.methods.registry import resolve_method
from kvbench.model.resolve import resolve_model
from kvbench.server.config import method_server_config
from kvbench.server.instances import InstancePlan, ServerGroup
from kvbench.server.mooncake_master import allocated_bytes

MODEL = "kvbench:roles-transferable"
ROUTINGS = ("trajectory", "agent", "round-robin", "cache-aware")
INSTANCES = 2  # the largest setup's
KVBENCH = [sys.executable, "-m", "kvbench"]


def run(args: list[str]) -> None:
    done = subprocess.run([*KVBENCH, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kvbench {' '.join(args[:2])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def reuse_turns(requests: pd.DataFrame) -> pd.DataFrame:
    """Turns the run planned a reuse for (a source named)."""
    return requests[requests["reusable_tokens"].fillna(0) > 0]


def reader_turns(requests: pd.DataFrame) -> pd.DataFrame:
    """Turns that read an earlier agent's output (every agent but the first): what a shared tier
    can serve, whether or not this run's servers could."""
    return requests[requests["edge_source"].notna()]


def load_frame(requests: pd.DataFrame, fetched: bool | None) -> pd.DataFrame:
    """Reuse turns' load times as a `ttft_ms` column (for the trajectory bootstrap), those that
    fetched a source from the shared tier (True), fetched none (False) or all (None)."""
    rows = []
    for r in reuse_turns(requests).itertuples():
        stats = json.loads(r.method_stats) if isinstance(r.method_stats, str) else {}
        if "load_s" not in stats or (fetched is not None and bool(stats.get("shared_fetches")) != fetched):
            continue
        rows.append({"trajectory_id": r.trajectory_id, "ttft_ms": stats["load_s"] * 1e3, "success": True,
                     "fetch_ms": stats.get("shared_fetch_s", 0.0) * 1e3})
    return pd.DataFrame(rows)


def loads(runs: pd.DataFrame, routings: tuple[str, ...], fetched: bool | None) -> pd.DataFrame:
    """The reuse turns' loads of the `runs` rows under `routings` (load_frame), together."""
    frames = [load_frame(pd.read_parquet(Path(d) / "requests.parquet"), fetched) for d in runs[runs.routing.isin(routings)].dir]
    return pd.concat(frames, ignore_index=True)


def figures(result_dir: Path, store_bytes: int | None) -> dict[str, Any]:
    summary = json.loads((result_dir / "summary.json").read_text())
    requests = pd.read_parquet(result_dir / "requests.parquet")
    reuse = reader_turns(requests)
    keys = ("realized_rho", "p50_ttft_ms", "p90_ttft_ms", "workflow_throughput", "task_accuracy_reuse",
            "shared_local_hits", "shared_remote_hits", "shared_misses", "shared_rejected", "shared_remote_bytes",
            "shared_remote_bytes_per_reused_token", "p50_shared_get_ms", "p90_shared_get_ms", "shared_puts",
            "shared_put_bytes", "shared_put_ms_total", "failed", "completed", "cold_start_dense_share",
            "shared_anchor_put_bytes", "shared_anchor_remote_bytes", "shared_anchors_imported", "shared_anchors_rejected")
    out = {key: summary.get(key) for key in keys}
    out["p50_reader_ttft_ms"] = float(reuse["ttft_ms"].median()) if len(reuse) else None
    out["p90_reader_ttft_ms"] = float(reuse["ttft_ms"].quantile(0.9)) if len(reuse) else None
    out["shared_store_bytes"] = store_bytes
    return out


def outputs(result_dir: Path) -> dict[tuple[str, str], list[int]]:
    requests = pd.read_parquet(result_dir / "requests.parquet")
    return {(r.trajectory_id, r.turn_id): list(r.output_token_ids) for r in requests.itertuples()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--trajectories", type=int, default=6)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=None,
                        help="[default: the role-recall task's, an answer's length: longer outputs run past the answer "
                             "and the next agents read that text, which the constructed model does not answer from]")
    parser.add_argument("--loaded-qps", default="2048:1,8192:0.25", help="CONTEXT:QPS pairs of the loaded runs")
    parser.add_argument("--methods", default="fullshared,kvcmas")
    parser.add_argument("--result-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--reanalyze", type=Path, nargs="+", default=None,
                        help="Recompute the figures from the run folders a previous --json (or the printed output) "
                             "names; nothing is run")
    args = parser.parse_args()
    if args.reanalyze is not None:
        rows = []
        for path in args.reanalyze:
            text = path.read_text()
            try:
                rows += json.loads(text)["runs"]
            except ValueError:  # the script's printed output: one JSON line per run
                rows += [row for line in text.splitlines() if line.startswith("{") and "dir" in (row := json.loads(line))]
        rows = [{**row, **figures(Path(row["dir"]), row.get("shared_store_bytes"))} for row in rows]
        return analyze(rows, sorted({row["context"] for row in rows}), args.json)
    root = args.result_dir or Path(tempfile.mkdtemp(prefix="bench-instances-"))
    contexts = [int(c) for c in args.contexts.split(",")]
    loaded = {int(c): float(q) for c, q in (pair.split(":") for pair in args.loaded_qps.split(","))}
    model = resolve_model(MODEL)
    traces = {}
    for context in contexts:
        traces[context] = root / f"trace-{context}.jsonl"
        run(["gen-trace", "-o", str(traces[context]), "--task", "role-recall", "--model", MODEL, "--qps", "0",
             "--num-trajectories", str(INSTANCES * args.warmups + args.trajectories), "--shared-tokens", str(context),
             *(["--output-len", str(args.output_len)] if args.output_len else [])])
    rows: list[dict[str, Any]] = []
    for method in args.methods.split(","):
        setups = [("1 instance", InstancePlan(instances=1, shared=False), ("trajectory",)),
                  ("2 instances, shared tier", InstancePlan(instances=2), ROUTINGS if method == "fullshared"
                   else ("trajectory", "agent"))]
        if method == "fullshared":
            setups.append(("2 instances, no shared tier", InstancePlan(instances=2, shared=False), ("agent",)))
        else:  # its pools as before issue 68: each instance learns from its own turns
            setups.append(("2 instances, per-instance pools", InstancePlan(instances=2), ("agent",)))
        for setup, plan, routings in setups:
            params = {"anchor_sharing": "instance"} if "per-instance" in setup else {}
            config = method_server_config(resolve_method(method, params), model, max_model_len=max(contexts) + 2048)
            folder = root / method / setup.replace(" ", "-").replace(",", "")
            print(f"starting {setup} ({method}) ...", file=sys.stderr, flush=True)
            with ServerGroup(config, plan, folder) as group:
                urls = [arg for url in group.base_urls for arg in ("--base-url", url)]
                # Not measured: a fresh server's first runs pay one-time costs (its first shapes, the
                # store's pages touched the first time: a first put cost 85 ms, later ones 9-20 ms),
                # which would fall on whichever routing ran first.
                for routing in dict.fromkeys((routings[0], routings[-1])):
                    run(["replay", "--trace", str(traces[max(contexts)]), "--method", method, "--qps", "0",
                         "--num-warmups", "0", "--num-trajectories", "2", "--routing", routing, *urls,
                         "--result-dir", str(folder / f"warmup-{routing}")])
                for context in contexts:
                    for qps in (0.0, loaded[context]):
                        for routing in routings:
                            out = folder / f"{context}-qps{qps:g}-{routing}"
                            # every setup: the same warm-ups (--warmups per instance of the largest setup:
                            # each instance's method state learns from those routed to it) and the same
                            # measured trajectories after them
                            run(["replay", "--trace", str(traces[context]), "--method", method, "--qps", f"{qps:g}",
                                 "--num-warmups", str(args.warmups * INSTANCES), "--num-trajectories",
                                 str(args.trajectories), "--prime-method-state", "--routing", routing,
                                 *urls, "--result-dir", str(out)])
                            # the store's memory now: this run's entries stay until the next run's reset
                            store = allocated_bytes(group.master.address.metrics_url) if group.master else None
                            row = {"method": method, "setup": setup, "context": context, "qps": qps,
                                   "routing": routing, "dir": str(out), **figures(out, store)}
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    analyze(rows, contexts, args.json)


def fullshared_figures(table: pd.DataFrame, context: int) -> dict[str, Any]:
    """The transfer's cost and FullShared's outputs at `context` (QPS 0)."""
    runs = table[(table.method == "fullshared") & (table.context == context) & (table.qps == 0)]
    shared = runs[runs.setup == "2 instances, shared tier"]
    if shared.empty:
        return {}
    # local reads: trajectory and cache-aware routing; remote: agent and round-robin (two runs each,
    # so neither side is only the runs a fresh store's first touches fell on)
    local_loads = loads(shared, ("trajectory", "cache-aware"), False)
    remote_loads = loads(shared, ("agent", "round-robin"), True)
    interval = p50_ratio_interval(remote_loads, local_loads)
    one = outputs(Path(runs[runs.setup == "1 instance"].dir.iloc[0]))
    store = shared[shared.routing == "agent"].shared_store_bytes.iloc[0]
    return {
        "remote_over_local_load": {"ratio": interval.ratio, "low": interval.low, "high": interval.high},
        "p50_load_ms_local": float(np.median(local_loads.ttft_ms)),
        "p50_load_ms_remote": float(np.median(remote_loads.ttft_ms)),
        "p50_fetch_ms_remote": float(np.median(remote_loads.fetch_ms)),
        # turns whose outputs differ from the one-instance run's, per routing on two instances
        "outputs_differing_from_one_instance": {
            row.routing: sum(theirs.get(turn) != ours for turn, ours in one.items())
            for row in shared.itertuples() if (theirs := outputs(Path(row.dir))) is not None},
        "turns": len(one), "shared_store_bytes": store,
        "every_instance_own_copy_bytes": None if store is None else 2 * store}


def kvcmas_against_one(table: pd.DataFrame, context: int) -> dict[str, Any]:
    """Per QPS, KVCMAS on two instances under agent routing (shared pools, per-instance pools)
    against one instance: rho's difference and the reader turns' p50 TTFT ratio with its 95%
    bootstrap interval over trajectories (paired: the same trajectories)."""
    out: dict[str, Any] = {}
    runs = table[(table.method == "kvcmas") & (table.context == context)]
    for qps in sorted(set(runs.qps)):
        at = runs[runs.qps == qps]
        one = at[at.setup == "1 instance"]
        if one.empty:
            continue
        one_requests = reader_turns(pd.read_parquet(Path(one.dir.iloc[0]) / "requests.parquet"))
        for setup in ("2 instances, shared tier", "2 instances, per-instance pools"):
            two = at[(at.setup == setup) & (at.routing == "agent")]
            if two.empty:
                continue
            interval = p50_ratio_interval(reader_turns(pd.read_parquet(Path(two.dir.iloc[0]) / "requests.parquet")),
                                          one_requests)
            out[f"{setup}, qps {qps:g}"] = {
                "rho_minus_one_instance": float(two.realized_rho.iloc[0]) - float(one.realized_rho.iloc[0]),
                "reader_p50_ttft_over_one_instance": {"ratio": interval.ratio, "low": interval.low,
                                                      "high": interval.high}}
    return out


def analyze(rows: list[dict[str, Any]], contexts: list[int], json_path: Path | None) -> None:
    """The per-context figures from the runs' rows; printed, and with the rows written to `json_path`."""
    table = pd.DataFrame(rows)
    result: dict[str, Any] = {"runs": rows, "per_context": {}}
    for context in contexts:
        figures_at = {**fullshared_figures(table, context), "kvcmas": {
            f"{row['setup']}, {row['routing']}, qps {row['qps']:g}": {key: row.get(key) for key in (
                "task_accuracy_reuse", "realized_rho", "cold_start_dense_share", "p50_reader_ttft_ms",
                "shared_remote_bytes", "shared_anchor_put_bytes", "shared_anchor_remote_bytes",
                "shared_anchors_imported", "shared_anchors_rejected")}
            for row in rows if row["method"] == "kvcmas" and row["context"] == context},
            "kvcmas_two_over_one": kvcmas_against_one(table, context)}
        result["per_context"][context] = figures_at
        print(json.dumps({"context": context, **figures_at}, default=float), flush=True)
    if json_path:
        json_path.write_text(json.dumps(result, indent=2, default=float) + "\n")

if __name__ == "__main__":
    main()
