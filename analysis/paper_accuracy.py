"""The paper's accuracy tables from benchmark-workload sweeps (`kvbench paper table1|5|6|8`, and
Table 13's accuracy column).

Accuracy is the FinalRefer answer's score per item (analysis/task_score.py). Each cell shows its
95% interval: Wilson's over the cell's items for one run, Student's t over repeats for several;
with a handful of items the interval spans most of [0, 100], and the table says what it is: a
check that the pipeline runs, not a finding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from scipy import stats

from kvbench.analysis.aggregate import method_params
from kvbench.analysis.paper_values import (
    PAPER_TAU,
    TABLE1_TASKS,
    TABLE6_MMLU,
    TABLE8_MMLU,
    method_order,
    table1_values,
    table5_values,
)

CONSTRUCTED_PREFIX = "kvbench:"  # embedded models: constructed for CPU checks, not language models
NO_RUNS = "No benchmark-workload runs here (`kvbench paper {name} --run --data mmlu=PATH ...`)."


def benchmark_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of benchmark workloads, in the paper's method order."""
    rows = frame[frame["task"].isin(TABLE1_TASKS)]
    order = rows["method"].map(method_order).rename("order")
    return rows.join(order).sort_values(["order", "method_config"], kind="stable").drop(columns="order")


def accuracy_cell(row: pd.Series) -> str:
    """Accuracy (%) with its 95% interval: over repeats when there are several, else Wilson's over items."""
    accuracy, items = row["task_accuracy"], row["task_items"]
    if pd.isna(accuracy):
        return "–"
    if row.get("repeats", 1) > 1 and not pd.isna(row.get("task_accuracy_ci")):
        low, high = accuracy - row["task_accuracy_ci"], accuracy + row["task_accuracy_ci"]
    elif not pd.isna(items) and items > 0:
        interval = stats.binomtest(round(accuracy * items), int(items)).proportion_ci(0.95, method="wilson")
        low, high = interval.low, interval.high
    else:
        low = high = math.nan
    text = f"{100 * accuracy:.1f}"
    return text + (f" [{100 * max(low, 0):.0f}, {100 * min(high, 1):.0f}]" if not math.isnan(low) else "")


def _by_task(frame: pd.DataFrame, cell: Callable[[pd.Series], str]) -> pd.DataFrame:
    tasks = [t for t in TABLE1_TASKS if t in set(frame["task"])]
    rows = []
    for method, group in frame.groupby("method_config", sort=False):
        by_task = {row["task"]: row for _, row in group.iterrows()}
        rows.append({"method": method, **{task: cell(by_task[task]) if task in by_task else "–" for task in tasks}})
    return pd.DataFrame(rows)


def _number(metric: str, digits: int) -> Callable[[pd.Series], str]:
    return lambda row: "–" if pd.isna(row[metric]) else f"{row[metric]:.{digits}f}"


def provenance(frame: pd.DataFrame) -> list[str]:
    """Which model, how many items, and, for a constructed model, that its accuracy means nothing."""
    models = sorted(set(map(str, frame["model"])))
    items = ", ".join(f"{t} {int(n)}" for t, n in frame.groupby("task")["task_items"].max().items() if not pd.isna(n))
    qps = ", ".join(f"{q:g}" for q in sorted(set(frame["qps"])))
    lines = [f"Model: {', '.join(models)}. Items scored per task: {items}. Trajectory QPS: {qps}.", ""]
    constructed = [m for m in models if m.startswith(CONSTRUCTED_PREFIX)]
    if constructed:
        lines += [f"**{', '.join(constructed)} is a constructed test model** shipped with kvbench to run on a CPU: it "
                  "was never trained on these benchmarks, so its accuracy says nothing about the methods. This "
                  "table checks that the pipeline (workload, replay, scoring, table) runs end to end.", ""]
    return lines


def _paper_by_task(methods: list[str], value: Callable[[str, str], float | None], digits: int) -> pd.DataFrame:
    rows = []
    for method in methods:
        cells = {task: value(method, task) for task in TABLE1_TASKS}
        if any(v is not None for v in cells.values()):
            rows.append({"method": method, **{t: "–" if v is None else f"{v:.{digits}f}" for t, v in cells.items()}})
    return pd.DataFrame(rows)


def render_table1(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    frame = benchmark_rows(frame)
    if frame.empty:
        return NO_RUNS.format(name="table1")
    paper = table1_values()
    methods = list(dict.fromkeys(frame["method"]))
    lines = provenance(frame)
    sections = [("final-answer accuracy (%; HumanEval: pass@1) [95% interval]", accuracy_cell, "accuracy", 2),
                ("mean TTFT (s; the paper's TTFT is averaged over each trajectory)", _number("mean_ttft_s", 3),
                 "ttft_s", 2),
                ("mean workflow latency (s)", _number("latency_s", 2), "latency_s", 2),
                ("realized rho (shared tokens served by reuse / reusable)", _number("realized_rho", 3), "rho", 2),
                ("method state (MiB; the paper: peak GPU memory, GB)", _number("method_state_mib", 1), "memory_gb", 2),
                ("final answers that could not be read", _number("task_unparseable", 0), None, 0)]
    for title, cell, paper_metric, digits in sections:
        lines += [f"### {title}", "", _by_task(frame, cell).to_markdown(index=False), ""]
        if with_paper and paper_metric is not None:
            table = _paper_by_task(methods, lambda m, t, k=paper_metric: paper.get((m, t, k)), digits)
            if len(table):
                lines += ["the paper (Table 1; A100, 1 QPS, its models, accuracy over three runs):", "",
                          table.to_markdown(index=False), ""]
    return "\n".join(lines)


def render_table5(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    frame = benchmark_rows(frame)
    if frame.empty:
        return NO_RUNS.format(name="table5")
    lines = provenance(frame)
    repeats = int(frame["repeats"].min())
    lines += [f"Standard deviation of accuracy (points) over {repeats} runs per cell (`--repeats`). With greedy "
              "decoding, runs differ only through batching and method state; `--temperature` samples each run.", ""]
    table = _by_task(frame, lambda row: "–" if pd.isna(row["task_accuracy_std"])
                     else f"{100 * row['task_accuracy_std']:.2f}")
    lines += ["### this machine", "", table.to_markdown(index=False), ""]
    if with_paper:
        paper = table5_values()
        lines += ["### the paper (Table 5)", "",
                  _paper_by_task(list(dict.fromkeys(frame["method"])), lambda m, t: paper.get((m, t)),
                                 2).to_markdown(index=False), ""]
    return "\n".join(lines)


def render_table6(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    frame = benchmark_rows(frame)
    frame = frame[frame["method"] == "kvcmas"]
    if frame.empty:
        return NO_RUNS.format(name="table6")
    rows = []
    for _, row in frame.iterrows():
        tau = method_params(row).get("tau")
        paper = TABLE6_MMLU.get(round(float(tau), 2)) if tau is not None and row["task"] == "mmlu" else None
        rows.append({"task": row["task"], "tau": tau, "accuracy (%) [95%]": accuracy_cell(row),
                     "rho": "–" if pd.isna(row["realized_rho"]) else f"{row['realized_rho']:.3f}",
                     **({"paper accuracy": paper[0] if paper else "–", "paper rho": paper[1] if paper else "–"}
                        if with_paper else {})})
    table = pd.DataFrame(rows).sort_values(["task", "tau"], na_position="first")
    lines = provenance(frame) + [
        "KVCMAS's reliability threshold tau against accuracy and realized rho (a higher tau accepts more "
        f"corrections). The paper's main settings: {', '.join(f'{t} {v}' for t, v in PAPER_TAU.items())}.", "",
        table.to_markdown(index=False, disable_numparse=True)]
    return "\n".join(lines)


def render_table8(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    frame = benchmark_rows(frame)
    frame = frame[frame["method"].isin(["kvcmas", "kvcmas-nonchained"])]
    if frame.empty:
        return NO_RUNS.format(name="table8")
    lines = provenance(frame) + ["Chained (KVCMAS) against non-chained (a context-free reference) correction.", "",
                                 "### accuracy (%) [95% interval], this machine", "",
                                 _by_task(frame, accuracy_cell).to_markdown(index=False), "",
                                 "### realized rho", "",
                                 _by_task(frame, _number("realized_rho", 3)).to_markdown(index=False), ""]
    if with_paper:
        lines += ["### the paper (Table 8, MMLU)", "", pd.DataFrame(
            [{"method": m, "mmlu": v} for m, v in TABLE8_MMLU.items()]).to_markdown(index=False), ""]
    return "\n".join(lines)
