"""The method x deviation matrix: every method's task accuracy on reuse turns on each role-family
model (kvbench.model.roles), beside what it reused, what it recomputed and its p50 TTFT.

Per cell (model, method, context, QPS): accuracy over reuse turns with a 95% interval (bootstrap
over trajectories: a trajectory's turns chain, so they are not independent), its gain over
FullShared's cell paired turn by turn with an exact McNemar p-value, realized rho, recompute
share and p50 TTFT. The noise floor of the task metric: NonShared under load against NonShared
at QPS 0, the share of turns whose answers differ. Written as CSV, JSON (`kvbench-deviation-
matrix`, version 1), markdown and a heatmap; `kvbench leaderboard` reads the same runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.analysis.intervals import cluster_mean_interval
from kvbench.analysis.leaderboard import recompute_share
from kvbench.analysis.runs import Run

SCHEMA = "kvbench-deviation-matrix"
SCHEMA_VERSION = 1
BOOTSTRAP_RESAMPLES = 2000
METHOD_ORDER = ("nonshared", "fullshared", "polykv", "kvcmas", "kvcmas-nonchained", "kvcomm", "kvcomm-ref",
                "graphflow", "cacheblend", "relaycaching", "droidspeak")
FAMILY_ORDER = ("roles-transferable", "roles-sparse", "roles-deep", "roles-content-bound")
COLUMNS = ["model", "method", "shared_tokens", "qps", "trajectories", "reuse_turns", "task_accuracy_reuse",
           "accuracy_low", "accuracy_high", "task_accuracy_first", "gain_over_fullshared", "gain_p_value",
           "realized_rho", "recompute_share", "p50_ttft_ms"]


def _scores(run: Run) -> pd.DataFrame | None:
    path = run.path / run_files.TASK_SCORES
    return pd.read_parquet(path) if path.exists() else None


def accuracy_interval(scores: pd.DataFrame, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the mean of `correct`, resampling whole trajectories."""
    return cluster_mean_interval(scores["correct"].astype(float), scores["trajectory_id"], confidence,
                                 BOOTSTRAP_RESAMPLES, seed)


def mcnemar_p(method: pd.Series, naive: pd.Series) -> float:
    """Exact two-sided McNemar test of paired right/wrong outcomes (aligned indexes)."""
    from scipy import stats

    better = int((method & ~naive).sum())
    worse = int((~method & naive).sum())
    if better + worse == 0:
        return 1.0
    return float(stats.binomtest(better, better + worse, 0.5).pvalue)


def _cell_key(run: Run) -> tuple[str, str, int, float]:
    return (run.model_name, run.name, int(run.shared_tokens or 0), float(run.summary.get("request_rate") or 0.0))


def deviation_matrix(runs: list[Run]) -> pd.DataFrame:
    """One row per (model, method configuration, context, QPS) that has task scores."""
    scored = {_cell_key(r): (r, s) for r in runs if not r.is_quality_baseline and (s := _scores(r)) is not None}
    rows = []
    for (model, method, context, qps), (run, scores) in scored.items():
        reuse = scores[scores["reuse_turn"]] if "reuse_turn" in scores else scores.iloc[0:0]
        first = scores[~scores["reuse_turn"]] if "reuse_turn" in scores else scores
        low, high = accuracy_interval(reuse)
        gain, p_value = math.nan, math.nan
        naive = scored.get((model, "fullshared", context, qps))
        if naive is not None and method != "fullshared" and len(reuse):
            keys = ["trajectory_id", "turn_id"]
            paired = reuse.merge(naive[1][keys + ["correct"]], on=keys, suffixes=("", "_naive"))
            if len(paired):
                gain = float(paired["correct"].mean() - paired["correct_naive"].mean())
                p_value = mcnemar_p(paired["correct"].astype(bool), paired["correct_naive"].astype(bool))
        rho = run.summary.get("realized_rho")
        rows.append({
            "model": model, "method": method, "shared_tokens": context, "qps": qps,
            "trajectories": int(scores["trajectory_id"].nunique()), "reuse_turns": len(reuse),
            "task_accuracy_reuse": float(reuse["correct"].mean()) if len(reuse) else math.nan,
            "accuracy_low": low, "accuracy_high": high,
            "task_accuracy_first": float(first["correct"].mean()) if len(first) else math.nan,
            "gain_over_fullshared": gain, "gain_p_value": p_value,
            "realized_rho": float(rho) if rho is not None else math.nan,
            "recompute_share": recompute_share(run), "p50_ttft_ms": run.summary.get("p50_ttft_ms", math.nan),
        })
    table = pd.DataFrame(rows, columns=COLUMNS)
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    family = {m: i for i, m in enumerate(FAMILY_ORDER)}
    table["_m"] = table["method"].map(lambda m: order.get(m, len(order)))
    table["_f"] = table["model"].map(lambda m: family.get(m.removeprefix("kvbench:"), len(family)))
    return (table.sort_values(["shared_tokens", "qps", "_f", "_m", "method"]).drop(columns=["_m", "_f"])
            .reset_index(drop=True))


def noise_floor(runs: list[Run]) -> pd.DataFrame:
    """Per model and context: NonShared's answers under each load against its QPS-0 answers."""
    nonshared = {_cell_key(r): s for r in runs if r.method == "nonshared" and not r.is_quality_baseline
                 and (s := _scores(r)) is not None}
    rows = []
    for (model, _, context, qps), scores in nonshared.items():
        single = nonshared.get((model, "nonshared", context, 0.0))
        if qps == 0.0 or single is None:
            continue
        keys = ["trajectory_id", "turn_id"]
        paired = scores.merge(single[keys + ["answer"]], on=keys, suffixes=("", "_single"))
        rows.append({"model": model, "shared_tokens": context, "qps": qps, "turns": len(paired),
                     "answers_changed": float((paired["answer"] != paired["answer_single"]).mean())
                     if len(paired) else math.nan})
    return pd.DataFrame(rows, columns=["model", "shared_tokens", "qps", "turns", "answers_changed"])


def _percent(value: float) -> str:
    return "–" if value is None or math.isnan(value) else f"{100 * value:.0f}"


def _share(value: float) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.2f}"


SIGNIFICANT_P = 0.01  # a gain over FullShared shown as significant (exact McNemar test)


def matrix_markdown(table: pd.DataFrame, floor: pd.DataFrame) -> str:
    """Per context and QPS: methods down, families across; each cell accuracy on reuse turns [95%
    interval] and realized rho (or recompute share for selective recomputation)."""
    lines = ["Task accuracy on reuse turns, % [95% interval], then realized rho / recompute share; **bold**: a "
             f"gain over FullShared significant at p < {SIGNIFICANT_P:g} (exact McNemar test on the paired turns). "
             "The kvbench:roles-* models are constructed test models (docs/models.md): each family makes one "
             "method family's assumption hold by construction.", ""]
    for (context, qps), block in table.groupby(["shared_tokens", "qps"], sort=True):
        models = [m for m in dict.fromkeys(block["model"])]
        lines += [f"### {context} shared tokens, QPS {qps:g}", "",
                  "| method | " + " | ".join(m.removeprefix("kvbench:") for m in models) + " |",
                  "|---|" + "---|" * len(models)]
        for method, rows in block.groupby("method", sort=False):
            cells = []
            for model in models:
                row = rows[rows["model"] == model]
                if not len(row):
                    cells.append("")
                    continue
                r = row.iloc[0]
                accuracy = _percent(r.task_accuracy_reuse)
                if r.gain_over_fullshared > 0 and r.gain_p_value < SIGNIFICANT_P:
                    accuracy = f"**{accuracy}**"
                cells.append(f"{accuracy} [{_percent(r.accuracy_low)}, {_percent(r.accuracy_high)}] "
                             f"rho {_share(r.realized_rho)} / rs {_share(r.recompute_share)}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    if len(floor):
        lines += ["Noise floor: NonShared's answers under load against its answers at QPS 0.", "",
                  "| model | context | QPS | turns | answers changed |", "|---|---|---|---|---|"]
        lines += [f"| {r.model} | {r.shared_tokens} | {r.qps:g} | {r.turns} | {100 * r.answers_changed:.1f}% |"
                  for r in floor.itertuples()]
    return "\n".join(lines) + "\n"


def heatmap(table: pd.DataFrame, path: Path) -> Path:
    """Accuracy on reuse turns, methods x families, one panel per (context, QPS); each cell
    annotated with its accuracy and realized rho."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    panels = list(table.groupby(["shared_tokens", "qps"], sort=True))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)) + 1, 5.5), squeeze=False)
    for ax, ((context, qps), block) in zip(axes[0], panels):
        methods = [m for m in METHOD_ORDER if m in set(block["method"])] + sorted(
            set(block["method"]) - set(METHOD_ORDER))
        models = [m for m in dict.fromkeys(block["model"])]
        grid = block.pivot_table(index="method", columns="model", values="task_accuracy_reuse").reindex(
            index=methods, columns=models)
        rho = block.pivot_table(index="method", columns="model", values="realized_rho").reindex(
            index=methods, columns=models)
        labels = grid.map(lambda v: "" if math.isnan(v) else f"{100 * v:.0f}") + rho.map(
            lambda v: "" if math.isnan(v) else f"\nρ{v:.2f}")
        sns.heatmap(grid, vmin=0, vmax=1, cmap="RdYlGn", annot=labels.to_numpy(), fmt="", cbar=False, ax=ax,
                    annot_kws={"fontsize": 7})
        ax.set_xticklabels([m.removeprefix("kvbench:roles-") for m in models], rotation=30, ha="right")
        ax.set(title=f"{context} tokens, QPS {qps:g}", xlabel="", ylabel="")
    fig.suptitle("Task accuracy on reuse turns (%) and realized rho, on constructed role-family models")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_matrix(runs: list[Run], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    table, floor = deviation_matrix(runs), noise_floor(runs)
    paths = {"csv": out_dir / "matrix.csv", "json": out_dir / "matrix.json", "markdown": out_dir / "matrix.md",
             "heatmap": out_dir / "matrix.png"}
    table.to_csv(paths["csv"], index=False)

    def clean(frame: pd.DataFrame) -> list[dict[str, Any]]:
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                for row in frame.to_dict(orient="records")]

    paths["json"].write_text(json.dumps({"schema": SCHEMA, "version": SCHEMA_VERSION, "columns": COLUMNS,
                                         "rows": clean(table), "noise_floor": clean(floor)}, indent=2) + "\n")
    paths["markdown"].write_text(matrix_markdown(table, floor))
    if len(table):
        heatmap(table, paths["heatmap"])
    else:
        del paths["heatmap"]
    return paths
