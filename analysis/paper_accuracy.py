"""The paper's accuracy tables from benchmark-workload sweeps (`kvbench paper table1`).

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

from kvbench.analysis.paper_values import TABLE1_ACCURACY

TASK_ORDER = ["mmlu", "gsm8k", "humaneval"]
CONSTRUCTED_PREFIX = "kvbench:"  # embedded models: constructed for CPU checks, not language models


def _accuracy_cell(row: pd.Series) -> str:
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
    tasks = [t for t in TASK_ORDER if t in set(frame["task"])]
    rows = []
    for method, group in frame.groupby("method_config", sort=False):
        by_task = {row["task"]: row for _, row in group.iterrows()}
        rows.append({"method": method, **{task: cell(by_task[task]) if task in by_task else "–" for task in tasks}})
    return pd.DataFrame(rows)


def render_table1(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    frame = frame[frame["task"].isin(TASK_ORDER)]
    if frame.empty:
        return "No benchmark-workload runs here (`kvbench paper table1 --run --data mmlu=PATH ...`)."
    models = sorted(set(frame["model"]))
    constructed = [m for m in models if str(m).startswith(CONSTRUCTED_PREFIX)]
    items = ", ".join(f"{t} {int(n)}" for t, n in frame.groupby("task")["task_items"].max().items() if not pd.isna(n))
    lines = [f"Model: {', '.join(map(str, models))}. Items scored per task: {items}. Single stream (QPS "
             f"{', '.join(f'{q:g}' for q in sorted(set(frame['qps'])))}).", ""]
    if constructed:
        lines += [f"**{', '.join(constructed)} is a constructed test model** shipped with kvbench to run on a CPU: it "
                  "was never trained on these benchmarks, so its accuracy says nothing about the methods. This "
                  "table checks that the pipeline (workload, replay, scoring, table) runs end to end.", ""]
    lines += ["### final-answer accuracy (%), this machine [95% interval]", "",
              _by_task(frame, _accuracy_cell).to_markdown(index=False), ""]
    if with_paper:
        paper = pd.DataFrame([{"method": m, **{t: f"{TABLE1_ACCURACY[(m, t)]:.1f}" if (m, t) in TABLE1_ACCURACY
                                                 else "–" for t in TASK_ORDER}}
                              for m in dict.fromkeys(frame["method"]) if any((m, t) in TABLE1_ACCURACY
                                                                              for t in TASK_ORDER)])
        if len(paper):
            lines += ["### final-answer accuracy (%), the paper's Table 1 (its models, full benchmarks)", "",
                      paper.to_markdown(index=False), ""]
    for metric, title, digits in (("p50_ttft_s", "p50 TTFT (s)", 3), ("latency_s", "mean workflow latency (s)", 2),
                                  ("method_state_mib", "method state (MiB)", 1),
                                  ("realized_rho", "realized rho (shared tokens served by reuse / reusable)", 3),
                                  ("task_unparseable", "final answers that could not be read", 0)):
        table = _by_task(frame, lambda row, m=metric, d=digits: "–" if pd.isna(row[m]) else f"{row[m]:.{d}f}")
        lines += [f"### {title}", "", table.to_markdown(index=False), ""]
    return "\n".join(lines)
