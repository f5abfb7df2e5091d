"""Benchmark: KVCMAS against NonShared, FullShared, its non-chained ablation and KVComm inside vLLM
(and CacheBlend beside them: --extra-methods).

Four agents, 128-token outputs, 2K and 8K shared tokens; each at QPS 0 (single stream) and one
loaded QPS per context. Prints, measured side by side in one run:
  - p50 TTFT per method and the ratios the KVCMAS paper claims (vs NonShared under load, vs
    FullShared, vs kvcmas-nonchained under load);
  - anchor-pool bytes KVComm / KVCMAS at equal V against L*D / (r*(L+D)), and server peak RSS;
  - normalized KV error ||C - C_dense||_F / ||C_dense||_F per method against a dense prefill of the
    same prompt, over every turn of the measured trajectories (the method at its realized rho) and
    over the turns whose shared query was served from a reused cache.

    .venv/bin/python benchmarks/bench_delta_methods.py [--contexts 2048,8192] [--loaded-qps 1,0.5] [--cold]
        [--kvcmas-tau 0.4] [--kvcmas-prematch] [--max-load-tokens-per-step 2048] [--repeats 3] [--result-dir DIR]

--kvcmas-tau adds KVCMAS at other reliability thresholds (other reuse ratios rho) beside the default
tau: the TTFT ratios and the KV error at each operating point, measured in the same run.
--kvcmas-prematch adds KVCMAS with `prematch` on (a saved turn's segments are matched against the
anchor pools after its first token, not at the next edge's load), at the default tau.

--repeats N replays each loaded cell N times, each with its own Poisson arrival schedule and freshly
primed method state, and computes the ratios over the pooled trajectories (each repeat's own ratio
printed beside them): one loaded run's median moves between identical runs by more than several
targets' margins.

By default the warm-up trajectories prime the methods' anchor pools (the steady state of a long
run); --cold starts every measured run with empty pools, as a fresh server would.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench import run_files
from kvbench.analysis.intervals import Per, RatioInterval, p50_ratio_interval, p50_ttft_ms
from kvbench.analysis.metrics import summarize
from kvbench.experiment.kv_errors import read_kv_errors, record_kv_errors
from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep

METHODS = [("nonshared", {}), ("fullshared", {}), ("kvcmas", {}), ("kvcmas-nonchained", {}), ("kvcomm", {"V": 10})]


def cell_row(label: str, context: int, qps: float, summary: dict) -> dict:
    """One replay's row of the table, from its summary."""
    state = summary.get("method_state_bytes") or {}
    return {
        "method": label, "context": context, "qps": qps,
        "p50_ttft_ms": summary["p50_ttft_ms"], "p90_ttft_ms": summary["p90_ttft_ms"],
        "p50_trajectory_ttft_ms": summary["p50_trajectory_ttft_ms"],
        "p99_itl_ms": summary.get("p99_itl_ms"),
        "failed": summary["failed"], "realized_rho": summary["realized_rho"],
        "pool_mib": state.get("peak_anchor_pool", 0) / 2**20,
        "references_mib": state.get("peak_references", 0) / 2**20,
        "peak_rss_mib": (summary.get("peak_server_rss_bytes") or 0) / 2**20,
        # how long the server took to serve the cell, and how long its trajectories took end to
        # end: beside the arrival span they show how far past a method's capacity a loaded QPS is
        "duration_s": summary["duration"],
        "trajectory_e2e_s": summary["mean_trajectory_e2e_ms"] / 1e3,
    }


def pool_repeats(repeats: list[pd.DataFrame]) -> pd.DataFrame:
    """The requests of a cell's repeats as one table; with more than one, trajectory ids get their
    repeat's prefix ("r1/t000004"), so a trajectory of each repeat is its own cluster in the
    bootstrap, and the same trajectory of the same repeat pairs across methods."""
    if len(repeats) == 1:
        return repeats[0]
    return pd.concat([run.assign(trajectory_id=f"r{i}/" + run["trajectory_id"].astype(str))
                      for i, run in enumerate(repeats)], ignore_index=True)


def pooled_row(rows: list[dict], requests: pd.DataFrame) -> dict:
    """A repeated cell's row: percentiles (TTFT, ITL) over the pooled requests and trajectories of
    every repeat, the trajectory E2E their mean, the duration the mean over repeats, memory the
    largest."""
    pooled = summarize(requests, float(np.mean([r["duration_s"] for r in rows])), [50, 90, 99])
    return rows[0] | {
        "p50_ttft_ms": pooled["p50_ttft_ms"], "p90_ttft_ms": pooled["p90_ttft_ms"],
        "p50_trajectory_ttft_ms": pooled["p50_trajectory_ttft_ms"], "p99_itl_ms": pooled["p99_itl_ms"],
        "failed": pooled["failed"], "realized_rho": pooled["realized_rho"],
        "pool_mib": max(r["pool_mib"] for r in rows), "references_mib": max(r["references_mib"] for r in rows),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in rows),
        "duration_s": pooled["duration"], "trajectory_e2e_s": pooled["mean_trajectory_e2e_ms"] / 1e3,
        "repeats": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--loaded-qps", default="1,0.5", help="loaded QPS per context (same order)")
    parser.add_argument("--trajectories", type=int, default=6, help="measured trajectories per QPS-0 cell")
    parser.add_argument("--loaded-trajectories", type=int, default=24,
                        help="measured trajectories per loaded cell: a p50 under load over 6 trajectories moved "
                             "by more than the targets' margins between identical runs; more trajectories narrow the "
                             "ratios' bootstrap intervals")
    parser.add_argument("--repeats", type=int, default=1,
                        help="replay each loaded cell N times, each with its own arrival schedule (arrival seeds 11..10+N) "
                             "and freshly primed method state: the ratios are then computed over the pooled "
                             "trajectories of all repeats, and each repeat's own ratio is printed beside them "
                             "(a loaded cell's median moves between identical runs)")
    parser.add_argument("--error-trajectories", type=int, default=6,
                        help="KV error over every turn of the last N measured trajectories (QPS 0 runs)")
    parser.add_argument("--warmups", type=int, default=3,
                        help="trajectories run first and not measured; they warm kernels and fill the anchor "
                             "pools (steady state) unless --cold")
    parser.add_argument("--cold", action="store_true",
                        help="reset method state after the warm-ups: anchor pools start empty (cold start)")
    parser.add_argument("--methods", default="",
                        help="a subset of the compared methods (comma-separated; default: all five); the target "
                             "ratios are printed only when all five ran")
    parser.add_argument("--extra-methods", default="cacheblend",
                        help="more methods measured beside the ones the targets compare (comma-separated; '' for none)")
    parser.add_argument("--kvcmas-tau", default="",
                        help="more KVCMAS operating points: reliability thresholds tau besides the default "
                             "(comma-separated), each a row `kvcmas(tau=X)` with its realized rho")
    parser.add_argument("--max-load-tokens-per-step", type=int, default=0,
                        help="0 (default): each load runs whole in the engine step that schedules it; N > 0: "
                             "asynchronous loads, about N tokens' worth of partial-forward layers per step, the "
                             "load with the least work left first (connector methods only)")
    parser.add_argument("--kvcmas-prematch", action="store_true",
                        help="also KVCMAS with prematch on (row `kvcmas(prematch)`): matching of a saved turn's "
                             "segments moves from the next edge's TTFT to after the saved turn's first token")
    parser.add_argument("--result-dir", type=Path, default=None,
                        help="the sweep directory: every cell's results (requests.parquet, summary.json, "
                             "kv_error.json) under DIR/runs/<method>/, for `kvbench report`; rerunning the same "
                             "command resumes it (default: a temporary folder)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: expected an integer >= 1")
    if args.max_load_tokens_per_step < 0:
        parser.error("--max-load-tokens-per-step: expected an integer >= 0")
    chosen = args.methods.split(",") if args.methods else [name for name, _ in METHODS]
    if unknown := set(chosen) - {name for name, _ in METHODS}:
        parser.error(f"--methods: not a compared method: {', '.join(sorted(unknown))} (others go in --extra-methods)")
    compared = [(name, name, params) for name, params in METHODS if name in chosen]
    try:
        taus = [float(t) for t in args.kvcmas_tau.split(",") if t]
    except ValueError:
        parser.error(f"--kvcmas-tau: expected comma-separated numbers, got {args.kvcmas_tau!r}")
    if any(not 0 <= t <= 1 for t in taus):
        parser.error("--kvcmas-tau: a normalized entropy threshold lies in [0, 1]")
    # (label, method, params): the label names the row, so one method may run at several settings
    variants = [(f"kvcmas(tau={t:g})", "kvcmas", {"tau": t}) for t in taus] \
        + ([("kvcmas(prematch)", "kvcmas", {"prematch": True})] if args.kvcmas_prematch else [])
    methods = compared + variants + [(m, m, {}) for m in args.extra_methods.split(",") if m]
    contexts = [int(c) for c in args.contexts.split(",")]
    loaded = dict(zip(contexts, (float(q) for q in args.loaded_qps.split(","))))
    spec = SweepSpec(
        methods=[MethodConfig(method, params, label) for label, method, params in methods],
        # every cell of a context replays the first trajectories of one seed-11 trace (a loaded
        # cell more of them); each repeat draws its own Poisson arrivals and primes anew
        points=[point for context in contexts for point in (
            SweepPoint(context, 0.0, args.trajectories, 1),
            SweepPoint(context, loaded[context], args.loaded_trajectories, args.repeats))],
        num_warmups=args.warmups, prime_method_state=not args.cold, seed=11, save_prompt_ids=True,
        server_options={"max_load_tokens_per_step": args.max_load_tokens_per_step})

    rows = []
    frames: dict[tuple[str, int, float], pd.DataFrame] = {}  # each cell's requests, for the intervals
    runs: dict[tuple[str, int, float], list[pd.DataFrame]] = {}  # a loaded cell's repeats, one frame each
    with (nullcontext(str(args.result_dir)) if args.result_dir is not None else tempfile.TemporaryDirectory()) as root:
        cells = run_sweep(spec, Path(root), on_cell=lambda name: print(f"done: {name}", flush=True),
                          after_cell=record_kv_errors(args.error_trajectories))
        for (label, context, qps), group in itertools.groupby(
                cells, key=lambda cell: (cell.method.name, cell.shared_tokens, cell.qps)):
            cell_rows, cell_runs = [], []
            for cell in group:
                summary = json.loads((cell.path / run_files.SUMMARY).read_text())
                cell_runs.append(pd.read_parquet(cell.path / run_files.REQUESTS))
                cell_rows.append(cell_row(label, context, qps, summary))
                cell_rows[-1] |= read_kv_errors(cell) or {}
                print(json.dumps(cell_rows[-1] | ({"repeat": cell.repeat} if qps and args.repeats > 1 else {})),
                      flush=True)
            runs[(label, context, qps)] = cell_runs
            frames[(label, context, qps)] = pool_repeats(cell_runs)
            rows.append(cell_rows[0] if len(cell_rows) == 1 else pooled_row(cell_rows, frames[(label, context, qps)]))
    table = pd.DataFrame(rows)
    print()
    print(table.to_markdown(index=False, floatfmt=".3f"))
    print()
    if len(compared) == len(METHODS):
        print_targets(table, frames, runs, contexts, loaded)
    print_load(table, contexts, loaded, args.loaded_trajectories)
    p50 = table.set_index(["method", "context", "qps"])["p50_ttft_ms"]
    errors = table[(table["qps"] == 0) & (table["method"] != "nonshared")].set_index(["method", "context"])
    if variants and {"fullshared", "kvcmas"} <= set(chosen):
        print_operating_points(table, contexts, loaded, [label for label, _, _ in variants])
    for method, _, _ in methods[len(compared) + len(variants):]:
        for context in contexts:
            e = errors.loc[(method, context)]
            versus = {q: (f" ({p50[(method, context, q)] / p50[('kvcmas', context, q)]:.2f}x KVCMAS)"
                          if ("kvcmas", context, q) in p50.index else "") for q in (0.0, loaded[context])}
            print(f"ctx {context}: {method} p50 {p50[(method, context, 0.0)]:.0f} ms at QPS 0{versus[0.0]}, "
                  f"{p50[(method, context, loaded[context])]:.0f} ms at QPS {loaded[context]:g}{versus[loaded[context]]}; "
                  f"KV error (all turns) {e['kv_error']:.4f} at rho {e['realized_rho']:.2f}")


def target_ratios(p50: pd.Series, label: str, context: int, qps: float) -> dict[str, float]:
    """The targets' ratios for the KVCMAS row `label` in one cell, from medians indexed by
    (method, context, qps): KVCMAS / FullShared, NonShared / KVCMAS and the share KVCMAS is below
    the non-chained ablation (the last two only where those methods ran)."""
    k = p50[(label, context, qps)]
    ratios = {"over_fullshared": k / p50[("fullshared", context, qps)]}
    if ("nonshared", context, qps) in p50.index:
        ratios["nonshared_over"] = p50[("nonshared", context, qps)] / k
    if ("kvcmas-nonchained", context, qps) in p50.index:
        ratios["below_nonchained"] = 1 - k / p50[("kvcmas-nonchained", context, qps)]
    return ratios


def _percent(share: float) -> str:
    """'26%'; a share that rounds to zero prints as '0%', not '-0%'."""
    return f"{round(share, 2) + 0.0:.0%}"


def _ci(interval: RatioInterval, unit: str) -> str:
    """'1.81x [1.40, 2.30]', or for unit '%' the share below the denominator: '26% [10%, 38%]'."""
    if unit == "%":
        return f"{_percent(1 - interval.ratio)} [{_percent(1 - interval.high)}, {_percent(1 - interval.low)}]"
    return f"{interval.ratio:.2f}x [{interval.low:.2f}, {interval.high:.2f}]"


def print_load(table: pd.DataFrame, contexts: list[int], loaded: dict[int, float], trajectories: int) -> None:
    """How far past each method's capacity the loaded QPS is. Its trajectories arrive over
    (n - 1) / QPS seconds; a server that keeps up finishes about one trajectory's E2E after the
    last arrival, and its trajectories take about as long end to end as at QPS 0. vLLM admits
    arriving requests into the next steps' token budget beside the running decodes (no request
    waits for KV memory on this model), so an overloaded server's backlog shows less in its TTFT
    than in its decoding: the run's duration and the trajectories' E2E."""
    cells = table.set_index(["method", "context", "qps"])
    for context in contexts:
        qps = loaded[context]
        span = (trajectories - 1) / qps
        parts = []
        for method in dict.fromkeys(table["method"]):
            busy, idle = cells.loc[(method, context, qps)], cells.loc[(method, context, 0.0)]
            parts.append(f"{method} {busy['duration_s']:.0f} s, trajectory E2E {busy['trajectory_e2e_s']:.1f} s "
                         f"({busy['trajectory_e2e_s'] / idle['trajectory_e2e_s']:.1f}x QPS 0)")
        print(f"ctx {context} qps {qps:g}: {trajectories} trajectories arrive over {span:.0f} s; served in "
              + "; ".join(parts))


def print_operating_points(table: pd.DataFrame, contexts: list[int], loaded: dict[int, float],
                           labels: list[str]) -> None:
    """KVCMAS at the default tau and at each extra one: its realized rho, the TTFT ratios of the
    targets (over both medians) and the KV error, so the targets can be read as functions of rho."""
    cells = table.set_index(["method", "context", "qps"])
    for label in ["kvcmas", *labels]:
        for context in contexts:
            error = cells.loc[(label, context, 0.0)]
            parts = [f"{label} ctx {context}: rho {error['realized_rho']:.2f} (QPS 0), KV error (all turns) "
                     f"{error['kv_error']:.4f} (FullShared {cells.loc[('fullshared', context, 0.0), 'kv_error']:.4f})"]
            for qps in (0.0, loaded[context]):
                ratios = []
                for column, short in (("p50_ttft_ms", "req"), ("p50_trajectory_ttft_ms", "traj")):
                    r = target_ratios(cells[column], label, context, qps)
                    text = f"{short}: /FullShared {r['over_fullshared']:.2f}x"
                    if "nonshared_over" in r:
                        text += f", NonShared/ {r['nonshared_over']:.2f}x"
                    if "below_nonchained" in r:
                        text += f", {_percent(r['below_nonchained'])} below non-chained"
                    ratios.append(text)
                parts.append(f"QPS {qps:g} (rho {cells.loc[(label, context, qps), 'realized_rho']:.2f}): "
                             + "; ".join(ratios))
            print("; ".join(parts[:1]) + "\n    " + "\n    ".join(parts[1:]))


def repeat_ratios(runs: dict[tuple[str, int, float], list[pd.DataFrame]], numerator: str, denominator: str,
                  context: int, qps: float, per: Per) -> list[float]:
    """numerator p50 / denominator p50 in each repeat of a cell on its own."""
    return [p50_ttft_ms(num, per) / p50_ttft_ms(den, per)
            for num, den in zip(runs[(numerator, context, qps)], runs[(denominator, context, qps)])]


def _each(ratios: list[float], unit: str) -> str:
    """'; repeats 2.10x 2.61x 1.93x' (or shares below for unit '%'); '' for a single run."""
    if len(ratios) < 2:
        return ""
    return "; repeats " + " ".join(_percent(1 - r) if unit == "%" else f"{r:.2f}x" for r in ratios)


def print_targets(table: pd.DataFrame, frames: dict[tuple[str, int, float], pd.DataFrame],
                  runs: dict[tuple[str, int, float], list[pd.DataFrame]], contexts: list[int],
                  loaded: dict[int, float]) -> None:
    """Issue 7's ratios, measured side by side, with 95% bootstrap intervals over trajectories
    (pooled over the repeats of a repeated cell, each repeat's own ratio beside them)."""
    # Two medians: vLLM's (over requests) and the paper's (over trajectories of their mean TTFT,
    # KVCMAS paper §4.1). The first weighs every dense turn on its own; the second averages each
    # trajectory's dense first agent with its reuse turns.
    for per, name in (("request", "p50 over requests"), ("trajectory", "p50 over trajectories")):
        for context in contexts:
            for qps in (0.0, loaded[context]):
                cell = {method: frames[(method, context, qps)]
                        for method in ("nonshared", "fullshared", "kvcmas", "kvcmas-nonchained")}
                vs_nonshared = p50_ratio_interval(cell["nonshared"], cell["kvcmas"], per=per)
                vs_fullshared = p50_ratio_interval(cell["kvcmas"], cell["fullshared"], per=per)
                vs_nonchained = p50_ratio_interval(cell["kvcmas"], cell["kvcmas-nonchained"], per=per)
                under_load = qps > 0
                each = {pair: _each(repeat_ratios(runs, *pair, context, qps, per), unit) for pair, unit in (
                    (("nonshared", "kvcmas"), "x"), (("kvcmas", "fullshared"), "x"),
                    (("kvcmas", "kvcmas-nonchained"), "%"))}
                print(f"[{name}] ctx {context} qps {qps:g}: "
                      f"NonShared/KVCMAS {_ci(vs_nonshared, 'x')}{each[('nonshared', 'kvcmas')]} (target >= 2 under load"
                      f"{': ' + vs_nonshared.verdict(at_least=2.0) if under_load else ''}); "
                      f"KVCMAS/FullShared {_ci(vs_fullshared, 'x')}{each[('kvcmas', 'fullshared')]} (target <= 1.3: "
                      f"{vs_fullshared.verdict(at_most=1.3)}); "
                      f"KVCMAS is {_ci(vs_nonchained, '%')}{each[('kvcmas', 'kvcmas-nonchained')]} lower than "
                      f"kvcmas-nonchained (target >= 30% under load"
                      f"{': ' + vs_nonchained.verdict(at_most=0.7) if under_load else ''})")
    errors = table[(table["qps"] == 0) & (table["method"] != "nonshared")].set_index(["method", "context"])
    for context in contexts:
        e = errors.xs(context, level="context")
        print(f"ctx {context}: KV error (all turns) KVCMAS {e.loc['kvcmas', 'kv_error']:.4f} at rho "
              f"{e.loc['kvcmas', 'realized_rho']:.2f}, KVComm {e.loc['kvcomm', 'kv_error']:.4f} at rho "
              f"{e.loc['kvcomm', 'realized_rho']:.2f}, FullShared {e.loc['fullshared', 'kv_error']:.4f} "
              "(targets: KVCMAS <= KVComm at equal rho, both < FullShared); turns with the query reused: "
              f"KVCMAS {e.loc['kvcmas', 'kv_error_q_reused']:.4f}, KVComm {e.loc['kvcomm', 'kv_error_q_reused']:.4f}, "
              f"FullShared {e.loc['fullshared', 'kv_error_q_reused']:.4f}")
    # Shapes of the embedded model: L layers is irrelevant to the ratio; D = KV features per layer.
    d = 4 * 32
    rank = 32
    pool = table[table["qps"] == 0].set_index(["method", "context"])["pool_mib"]
    for context in contexts:
        bound = context * d / (rank * (context + d))
        print(f"ctx {context}: pool bytes KVComm/KVCMAS (V=10 both) {pool[('kvcomm', context)] / pool[('kvcmas', context)]:.2f}"
              f" (target >= L*D/(r*(L+D)) = {bound:.2f})")


if __name__ == "__main__":
    main()
