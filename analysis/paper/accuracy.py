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
from kvbench.analysis.paper.format import paper_number, paper_section, peak_memory
from kvbench.analysis.paper.methods import method_order, paper_name
from kvbench.analysis.paper.values import (
    PAPER_TAU,
    TABLE1_ORDER,
    TABLE1_TASKS,
    TABLE6_MMLU,
    TABLE8_MMLU,
    table1_values,
    table4_values,
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


def _paper_by_task(value: Callable[[str, str], float | None], digits: int) -> pd.DataFrame:
    """One of the paper's per-benchmark columns, every method it ran in its order."""
    return pd.DataFrame([{"method": paper_name(method), **{t: paper_number(value(method, t), digits)
                                                          for t in TABLE1_TASKS}}
                         for method in TABLE1_ORDER])


def render_table1(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    frame = benchmark_rows(frame)
    if frame.empty:
        return NO_RUNS.format(name="table1")
    paper = table1_values()
    frame = frame.assign(peak_memory_gib=peak_memory(frame))
    lines = provenance(frame)
    sections = [("final-answer accuracy (%; HumanEval: pass@1) [95% interval]", accuracy_cell, "accuracy", 2),
                ("TTFT (s): each trajectory's mean TTFT, averaged over trajectories (the paper's)",
                 _number("mean_trajectory_ttft_s", 3), "ttft_s", 2),
                ("mean workflow latency (s)", _number("latency_s", 2), "latency_s", 2),
                ("realized rho (shared tokens served by reuse / reusable)", _number("realized_rho", 3), "rho", 2),
                ("peak memory (GiB: a GPU's peak allocated; on a CPU its twin, weights + KV pool + store + method "
                 "state from their tensors)", _number("peak_memory_gib", 2), "memory_gb", 2),
                ("method state (MiB)", _number("method_state_mib", 1), None, 0),
                ("final answers that could not be read", _number("task_unparseable", 0), None, 0)]
    for title, cell, paper_metric, digits in sections:
        lines += [f"### {title}", "", _by_task(frame, cell).to_markdown(index=False), ""]
        if with_paper and paper_metric is not None:
            lines += paper_section(f"{title.split(' (')[0].split(':')[0]}, Table 1(a) (A100, 1 QPS, its models, "
                                   "accuracy over three runs)",
                                   _paper_by_task(lambda m, t, k=paper_metric: paper.get((m, t, k)), digits))
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
        lines += paper_section("Table 5 (LLM columns)", _paper_by_task(lambda m, t: paper.get((m, t)), 2))
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
                        if with_paper else {}), "configuration": row["method_config"]})
    table = pd.DataFrame(rows).sort_values(["task", "tau"], na_position="first")
    lines = provenance(frame) + [
        "KVCMAS's reliability threshold tau against accuracy and realized rho (a higher tau accepts more "
        f"corrections). The paper's main settings: {', '.join(f'{t} {v}' for t, v in PAPER_TAU.items())}.", "",
        table.to_markdown(index=False, disable_numparse=True), ""]
    if with_paper:
        lines += paper_section("Table 6 (MMLU column)", pd.DataFrame(
            [{"tau": f"{tau:.2f}", "accuracy": paper_number(acc, 2), "rho": paper_number(rho, 3)}
             for tau, (acc, rho) in sorted(TABLE6_MMLU.items())]))
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
        lines += paper_section("Table 8 (MMLU column)", pd.DataFrame(
            [{"method": {"kvcmas": "Chained", "kvcmas-nonchained": "Non-chained"}[m], "mmlu": paper_number(v, 2)}
             for m, v in TABLE8_MMLU.items()]))
    return "\n".join(lines)


def render_table4(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    """Table 4: each trajectory's length (its longest request: prompt and output, model tokens),
    averaged and at its maximum over the items, per method and benchmark."""
    frame = benchmark_rows(frame)
    if frame.empty:
        return NO_RUNS.format(name="table4")
    lines = provenance(frame) + ["Trajectory length in model tokens: a trajectory's longest request, its prompt "
                                 "and output (the final agent's, which reads every earlier output).", ""]
    for statistic in ("average", "maximum"):
        metric = "mean_trajectory_tokens" if statistic == "average" else "max_trajectory_tokens"
        lines += [f"### {statistic} trajectory length (tokens), this machine", "",
                  _by_task(frame, _number(metric, 0)).to_markdown(index=False), ""]
    if with_paper:
        paper = table4_values()
        lines += paper_section("Table 4 (LLM columns; its models' tokenizers)", pd.DataFrame(
            [{"method": paper_name(m), **{f"{t} {stat}": paper_number(paper[(m, t, stat)], 0, True)
                                          for t in TABLE1_TASKS for stat in ("average", "maximum")}}
             for m in TABLE1_ORDER]))
    return "\n".join(lines)


def render_fig4(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    """Fig. 4: accuracy against end-to-end latency per benchmark; the band between FullShared and
    NonShared shaded, ours in the top row and the paper's (Table 1) below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = benchmark_rows(frame)
    if frame.empty:
        return NO_RUNS.format(name="fig4")
    tasks = [t for t in TABLE1_TASKS if t in set(frame["task"])]
    paper = table1_values()
    rows = 2 if with_paper else 1
    fig, axes = plt.subplots(rows, len(tasks), figsize=(5 * len(tasks), 4 * rows), squeeze=False)
    points = []
    for column, task in enumerate(tasks):
        ours = frame[frame["task"] == task]
        series = [(r["method_config"], r["method"], r["latency_s"], 100 * r["task_accuracy"]) for _, r in ours.iterrows()]
        panels = [("this machine", series)]
        if with_paper:
            panels.append(("the paper", [(paper_name(m), m, paper[(m, task, "latency_s")], paper[(m, task, "accuracy")])
                                         for m in TABLE1_ORDER]))
        for row, (source, marks) in enumerate(panels):
            ax = axes[row][column]
            bounds = [acc for _, m, _, acc in marks if m in ("fullshared", "nonshared") and not pd.isna(acc)]
            if len(bounds) == 2:
                ax.axhspan(min(bounds), max(bounds), color="grey", alpha=0.15)
            for name, _, latency, acc in marks:
                ax.scatter(latency, acc, label=name)
                points.append({"source": source, "task": task, "method": name, "latency (s)": f"{latency:.2f}",
                               "accuracy (%)": f"{acc:.2f}"})
            ax.set(title=f"{task}, {source}", xlabel="end-to-end latency (s)", ylabel="accuracy (%)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Accuracy against latency (cf. paper Fig. 4; upper left is better)")
    fig.tight_layout()
    fig.savefig(out / "fig4.png", dpi=120)
    plt.close(fig)
    plotted = pd.DataFrame(points)
    lines = provenance(frame) + ["Each method's accuracy against its mean workflow latency; the shaded band spans "
                                 "FullShared to NonShared.", "", "### points, this machine", "",
                                 plotted[plotted["source"] == "this machine"].drop(columns="source")
                                 .to_markdown(index=False, disable_numparse=True), ""]
    if with_paper:
        lines += paper_section("Fig. 4's LLM panels (Table 1(a))", plotted[plotted["source"] == "the paper"]
                               .drop(columns="source"))
    return "\n".join(lines + ["![Fig. 4](fig4.png)"])
