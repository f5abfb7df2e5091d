"""`kvbench leaderboard`: one row per method configuration and workload of a sweep, quality and
savings side by side, in KVShareArena's spirit: PGR (quality recovered) with its interval and its
gain over naive reuse, the share of shared (token, layer) entries computed, the TTFT saved against
NonShared of the same workload, and the method's memory.

Ranked within each model by PGR (highest first; undefined last), then by TTFT saved: quality
first, because a method that is fast by reading the wrong cache is not a result. Never across
models: kvbench's constructed role families are each built so that some methods' deviations hold
on them and others' do not, so a rank across families measures the constructions. Written as markdown, CSV and JSON
(`kvbench-leaderboard`, schema version 1)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from kvbench.analysis import metric_catalog
from kvbench.analysis.markdown_table import NOT_MEASURED, markdown_table
from kvbench.analysis.runs import Run, mean_summary, referenced_runs
from kvbench.model.store import is_constructed

SCHEMA = "kvbench-leaderboard"
# 2: a row per model too (`model`), task accuracy on reuse turns. 3: `pgr` is KVShareArena's (over
# a task's score), `output_pgr` the one over token F1 (named `pgr` before). 4: `saturated`. 5: `rank`
# within the row's model, rows grouped by model.
SCHEMA_VERSION = 5
SORT_RULE = ("within each model: PGR over the task where any run has one, else output PGR, else task accuracy on "
             "reuse turns, else task accuracy, descending (undefined last), then TTFT saved against NonShared descending")
# The quality figures rows are ranked by, first present first: never by speed alone, which would put
# the fastest wrong method on top.
RANK_KEYS = ("pgr", "output_pgr", "task_accuracy_reuse", "task_accuracy")
PGR_COLUMNS = ["pgr", "pgr_low", "pgr_high", "pgr_gain_over_naive", "pgr_gain_p_value", "output_pgr",
               "output_pgr_low", "output_pgr_high", "output_pgr_gain_over_naive", "output_pgr_gain_p_value"]
COLUMNS = ["model", "rank", "cell", "method", "shared_tokens", "qps", *PGR_COLUMNS, "exact_match_rate", "task_accuracy",
           "task_accuracy_reuse", "recompute_share", "ttft_saved", "p50_ttft_ms", "p50_workflow_ms",
           "workflow_goodput_share", "method_state_mib", "realized_rho", "failed", "saturated", "runs"]
# The leaderboard's own columns (the rest are the metric catalog's, its legend from there)
OWN_COLUMNS = {
    "rank": "within the row's model, by the sort above",
    "ttft_saved": "1 - p50 TTFT / NonShared's p50 TTFT of the same workload (share)",
    "pgr_gain_over_naive": "PGR over naive reuse's (`kvbench quality --naive`), with its Wilcoxon `pgr_gain_p_value`",
    "p50_ttft_ms": "request-level p50 TTFT (ms), mean over the cell's runs",
    "p50_workflow_ms": "a workflow's p50 makespan: first arrival to its last agent's last token (ms)",
    "saturated": "the share of the cell's runs that stopped over-saturated",
    "runs": "the cell's runs (repeats averaged)",
}
ORACLE = {key: 1.0 for key in ("pgr", "pgr_low", "pgr_high", "output_pgr", "output_pgr_low", "output_pgr_high")}


def recompute_share(run: Run) -> float:
    """Shared (token, layer) entries computed / all shared entries the method could have reused:
    the connector's own count where it reports one, else 1 - realized rho (each reused token
    served in every layer; 0 reuse for NonShared)."""
    if run.method == "nonshared":
        return 1.0
    reported = run.summary.get("recompute_share")
    if reported is not None:
        return float(reported)
    rho = run.summary.get("realized_rho")
    return 1.0 - float(rho) if rho is not None else math.nan


def leaderboard(runs: list[Run]) -> pd.DataFrame:
    """Rows by model and cell, repeats averaged; TTFT saved against the NonShared cell of the same
    model and workload. PGR's floors (no-context runs) are no rows; a run the others were compared
    with has PGR 1 (its outputs are the oracle)."""
    references = referenced_runs(runs)
    by_cell: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        if not run.is_floor:
            by_cell.setdefault((run.model_name, run.cell), []).append(run)

    nonshared = {(model, rs[0].workload): mean_summary(rs, "p50_ttft_ms") for (model, _), rs in by_cell.items()
                 if rs[0].method == "nonshared"}
    rows = []
    for (model, cell), cell_runs in by_cell.items():
        first = cell_runs[0]
        p50 = mean_summary(cell_runs, "p50_ttft_ms")
        base = nonshared.get((model, first.workload), math.nan)
        oracle = all(r.path.resolve() in references for r in cell_runs)
        rows.append({
            "model": model, "cell": cell, "method": first.method, "shared_tokens": first.shared_tokens,
            "qps": first.summary.get("request_rate"),
            **{key: mean_summary(cell_runs, key) for key in (*PGR_COLUMNS, "exact_match_rate", "task_accuracy",
                                                       "task_accuracy_reuse", "realized_rho", "failed")},
            **(ORACLE if oracle else {}),
            "recompute_share": sum(recompute_share(r) for r in cell_runs) / len(cell_runs),
            "ttft_saved": 1 - p50 / base if base and not math.isnan(base) else math.nan,
            "p50_ttft_ms": p50,
            # the whole workflow's makespan, and the share of workflows meeting the run's --goodput bounds
            "p50_workflow_ms": mean_summary(cell_runs, "p50_workflow_ms"),
            "workflow_goodput_share": mean_summary(cell_runs, "workflow_goodput_share"),
            "method_state_mib": sum(r.memory()["method_state_mib"] for r in cell_runs) / len(cell_runs),
            # the share of the cell's runs that stopped over-saturated: their figures are no steady state
            "saturated": sum(r.saturated for r in cell_runs) / len(cell_runs),
            "runs": len(cell_runs),
        })
    table = pd.DataFrame(rows, columns=[c for c in COLUMNS if c != "rank"])
    ranked = []
    for _, group in table.groupby("model", sort=True):  # a rank means something within one model only
        first = next((key for key in RANK_KEYS if group[key].notna().any()), "ttft_saved")
        group = group.sort_values(list(dict.fromkeys([first, "ttft_saved"])), ascending=False, na_position="last",
                                  kind="stable")
        ranked.append(group.assign(rank=range(1, len(group) + 1)))
    return (pd.concat(ranked) if ranked else table.assign(rank=[])).reindex(columns=COLUMNS).reset_index(drop=True)


def write_leaderboard(runs: list[Run], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = leaderboard(runs)
    paths = {"csv": out_dir / "leaderboard.csv", "json": out_dir / "leaderboard.json",
             "markdown": out_dir / "leaderboard.md"}
    table.to_csv(paths["csv"], index=False)
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in table.to_dict(orient="records")]
    paths["json"].write_text(json.dumps({"schema": SCHEMA, "version": SCHEMA_VERSION, "sort": SORT_RULE,
                                         "columns": COLUMNS, "rows": rows}, indent=2) + "\n")
    note = ("" if table[["pgr", "output_pgr"]].notna().any().any() else
            "\nNo run here has a PGR: compare them with a reference and a floor first "
            "(`kvbench quality RUN... --reference NONSHARED_RUN --floor DROP_SHARED_RUN`).\n")
    without_base = sorted(set(table.loc[table["ttft_saved"].isna() & (table["method"] != "nonshared"), "cell"]))
    if without_base:
        note += (f"\n`ttft_saved` is empty for {', '.join(without_base)}: no NonShared run of the same workload and "
                 "QPS is among the runs given (add `nonshared` to the sweep's --methods).\n")
    saturated = sorted(set(table.loc[table["saturated"] > 0, "cell"]))
    if saturated:
        note += (f"\nSaturated (`saturated` > 0): {', '.join(saturated)} stopped early, backlog and TTFT growing without "
                 "bound: their TTFT and goodput describe a growing queue, not a steady state at that QPS.\n")
    constructed = sorted(m for m in set(table["model"]) if is_constructed(m))
    if constructed:
        note += (f"\n{', '.join(constructed)}: constructed test models (docs/models.md), whose shared caches depend on "
                 "the reading agent by construction; `task_accuracy_reuse` is their measure of what reuse costs. What "
                 "such a row shows is that the method works inside vLLM as its deviation assumes, on a model built so "
                 "that the assumption holds or fails: each family favours some methods by design, so ranks hold within "
                 "a model, never across.\n")
    legend = [f"- `{key}`: {text}" for key, text in (*OWN_COLUMNS.items(), *metric_catalog.notes(("leaderboard",)))]
    paths["markdown"].write_text(
        f"# kvbench leaderboard\n\nSorted by {SORT_RULE}.\n{note}\n"
        f"{markdown_table(table, '.3f')}\n\n## Columns\n\n`{NOT_MEASURED}`: not measured for that row (no reference, floor "
        "or task score; no NonShared run of its workload).\n\n" + "\n".join(legend) + "\n")
    return paths
