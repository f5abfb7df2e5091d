"""Benchmark: agents as LoRA adapters (issue 41): what PReCache's two methods save and cost beside
NonShared, FullShared and KVCMAS, with and without a writer change.

On `kvbench:roles-adapter` (a constructed test model: each role's reading of the role-recall
table lives in its V-only route adapter, kvbench.model.role_adapters), two scenarios:

- writer-change: `--roles role-recall`, each role its own route adapter, readings alternating
  along the workflow: every reuse edge reads a cache another adapter wrote.
- same-adapter: `--roles role-recall-main`, one route adapter for every agent: the writer and
  the readers run the same adapter (a cache is reused under the adapter that wrote it).

Per scenario, context (default 2K and 8K) and QPS (0 and --loaded-qps): task accuracy on reuse
turns with its 95% interval and its gain over FullShared (McNemar p), PGR over the task score
(KVShareArena's, against a NonShared reference and a no-context floor), p50 TTFT and its ratio to
NonShared's, request throughput, the method state's peak (LR caches, ReBase's base caches) and the
LR cache's bytes per token and adapter as the worker counted them from its tensors. The segment
store every connector method keeps (the saved caches) is not in the method state.

    .venv/bin/python benchmarks/bench_precache.py --result-dir DIR [--contexts 2048,8192] \\
        [--trajectories 8] [--loaded-qps 0.5] [--methods ...]

Writes DIR/precache.md and DIR/precache.json (the runs stay in DIR/sweeps for `kvbench report`).
What the table shows is a finding on a constructed model, not a target.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import pandas as pd

from kvbench.analysis.deviation import deviation_matrix
from kvbench.analysis.runs import Run, find_runs
from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep
from kvbench.model.resolve import resolve_model
from kvbench.model.role_adapters import build_route_adapter
from kvbench.tracegen.roles import roles_for
from kvbench.tracegen.tasks.recall import recall_output_len
from kvbench.tracegen.tokenizer import load_tokenizer

MODEL = "kvbench:roles-adapter"
METHODS = "nonshared,fullshared,precache-prelr,precache-rebase,kvcmas"
AGENTS = 4


def scenario_adapters(root: Path) -> dict[str, dict[str, str]]:
    """role -> adapter folder, per scenario (the route adapters built once under `root`)."""
    model = resolve_model(MODEL)
    routes = {reading: str(build_route_adapter(model, root / f"route-{word}", reading))
              for reading, word in ((0, "main"), (1, "fallback"))}
    writer_change = {role.name: routes[role.reading or 0] for role in roles_for("role-recall", AGENTS)}
    # distinct folders for distinct readings: vLLM serves each under its folder's name
    return {"writer-change": writer_change,
            "same-adapter": {role.name: routes[0] for role in roles_for("role-recall-main", AGENTS)}}


def _lr_bytes_per_token(run: Run) -> float:
    """The LR cache's bytes per token and adapter, as the worker measured them (its loads' mean)."""
    requests = pd.read_parquet(run.path / "requests.parquet", columns=["method_stats"])
    values = [json.loads(s).get("lr_cache_bytes_per_token_adapter") for s in requests["method_stats"] if isinstance(s, str)]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def scenario_table(runs: list[Run], scenario: str) -> pd.DataFrame:
    table = deviation_matrix(runs)
    by_cell = {(r.name, int(r.shared_tokens or 0), float(r.summary.get("request_rate") or 0.0)): r
               for r in runs if not r.is_quality_baseline}
    extra = []
    for row in table.itertuples():
        run = by_cell[(row.method, row.shared_tokens, row.qps)]
        nonshared = by_cell.get(("nonshared", row.shared_tokens, row.qps))
        state = run.summary.get("method_state_bytes") or {}
        extra.append({
            "ttft_vs_nonshared": (row.p50_ttft_ms / nonshared.summary["p50_ttft_ms"]) if nonshared else math.nan,
            "request_throughput": run.summary.get("request_throughput", math.nan),
            "pgr": run.summary.get("pgr", math.nan), "pgr_low": run.summary.get("pgr_low", math.nan),
            "pgr_high": run.summary.get("pgr_high", math.nan),
            "state_peak_mib": run.memory()["method_state_mib"] - run.memory()["store_peak_mib"],
            "lr_cache_peak_mib": state.get("peak_lr_cache", 0) / 2**20,
            "base_cache_peak_mib": state.get("peak_base_cache", 0) / 2**20,
            "lr_bytes_per_token_adapter": _lr_bytes_per_token(run),
        })
    return pd.concat([table.assign(scenario=scenario), pd.DataFrame(extra, index=table.index)], axis=1)


def _f(value: float, digits: int = 2) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown(table: pd.DataFrame) -> str:
    lines = ["| scenario | ctx | QPS | method | accuracy (reuse) [95% CI] | gain vs FullShared (p) | PGR [95% CI] | "
             "p50 TTFT ms | x NonShared | req/s | method state MiB (LR, base) | LR B/token/adapter |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        gain = "–" if math.isnan(r.gain_over_fullshared) else f"{r.gain_over_fullshared:+.2f} ({r.gain_p_value:.2g})"
        lines.append(
            f"| {r.scenario} | {r.shared_tokens // 1024}K | {r.qps:g} | {r.method} | "
            f"{_f(r.task_accuracy_reuse)} [{_f(r.accuracy_low)}, {_f(r.accuracy_high)}] | {gain} | "
            f"{_f(r.pgr)} [{_f(r.pgr_low)}, {_f(r.pgr_high)}] | {_f(r.p50_ttft_ms, 0)} | {_f(r.ttft_vs_nonshared)} | "
            f"{_f(r.request_throughput)} | {_f(r.state_peak_mib, 1)} ({_f(r.lr_cache_peak_mib, 1)}, "
            f"{_f(r.base_cache_peak_mib, 1)}) | "
            f"{_f(r.lr_bytes_per_token_adapter, 0)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", type=Path, required=True)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--loaded-qps", type=float, default=0.5, help="the loaded cell's QPS (0: single stream only)")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument("--scenarios", default="writer-change,same-adapter")
    args = parser.parse_args()
    qps = [0.0] + ([args.loaded_qps] if args.loaded_qps > 0 else [])
    points = [SweepPoint(int(c), q) for c in args.contexts.split(",") for q in qps]
    adapters = scenario_adapters(args.result_dir / "adapters")
    roles = {"writer-change": "role-recall", "same-adapter": "role-recall-main"}
    tables = []
    for scenario in args.scenarios.split(","):
        spec = SweepSpec(methods=[MethodConfig(m) for m in args.methods.split(",")], points=points,
                         task="role-recall", roles=roles[scenario], adapters=adapters[scenario], agents=[AGENTS],
                         output_len=recall_output_len(load_tokenizer(MODEL).encode), num_trajectories=args.trajectories,
                         num_warmups=args.warmups, prime_method_state=True, seed=args.seed, model=MODEL, quality=True)
        started = time.monotonic()
        root = args.result_dir / "sweeps" / scenario
        run_sweep(spec, root, on_cell=lambda name, s=scenario: print(f"[{time.strftime('%H:%M:%S')}] {s}: {name}",
                                                                      flush=True))
        print(f"{scenario}: done in {(time.monotonic() - started) / 60:.1f} min", flush=True)
        tables.append(scenario_table(find_runs([root]), scenario))
    table = pd.concat(tables, ignore_index=True)
    (args.result_dir / "precache.md").write_text(markdown(table))
    (args.result_dir / "precache.json").write_text(table.to_json(orient="records", indent=1))
    print(markdown(table))


if __name__ == "__main__":
    main()
