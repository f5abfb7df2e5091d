"""What every `kvbench paper` table shares: cells with their intervals, grids pivoted into the
paper's layout, the paper's own values printed as it prints them, and what a latency table's speed
was bought with (realized rho, quality)."""

from __future__ import annotations

import pandas as pd

from kvbench.analysis.paper.methods import method_order

# Every table of the paper's values starts with this heading (tests find them by it).
PAPER_HEADING = "### the paper"


def fmt(value: float, ci: float | None = None, digits: int = 2) -> str:
    if pd.isna(value):
        return "–"
    text = f"{value:.{digits}f}"
    return text + (f" ±{ci:.{digits}f}" if ci is not None and not pd.isna(ci) else "")


def paper_number(value: float | None, digits: int, thousands: bool = False) -> str:
    """A value as the paper prints it (None: its "oom")."""
    if value is None:
        return "oom"
    return f"{value:,.{digits}f}" if thousands else f"{value:.{digits}f}"


def paper_section(title: str, table: pd.DataFrame) -> list[str]:
    """The paper's values under PAPER_HEADING: label columns first, then its numbers as printed."""
    return [f"{PAPER_HEADING}: {title}", "", table.to_markdown(index=False, disable_numparse=True), ""]


def in_paper_order(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted as the paper's tables list methods (NonShared first), configurations kept apart."""
    order = frame["method"].map(method_order).rename("_order")
    return frame.join(order).sort_values(["_order", "method_config"], kind="stable").drop(columns="_order")


def pivot(frame: pd.DataFrame, rows: list[str], columns: list[str], metric: str, digits: int = 2) -> pd.DataFrame:
    """`metric` (with its interval, and over-saturated cells marked) by rows x columns, rows in the
    paper's method order."""
    saturated = frame["saturated"] if "saturated" in frame else pd.Series(0.0, index=frame.index)
    cells = frame.assign(cell=[fmt(v, c, digits) + (" (sat.)" if s > 0 else "")  # stopped over-saturated
                               for v, c, s in zip(frame[metric], frame[f"{metric}_ci"], saturated.fillna(0))])
    table = cells.pivot_table(index=rows, columns=columns, values="cell", aggfunc="first")
    if rows[0] == "method_config" and "method" in frame:
        order = {c: method_order(m) for c, m in zip(frame["method_config"], frame["method"])}
        table = table.iloc[sorted(range(len(table)), key=lambda i: (order.get(_first(table.index[i]), 99),
                                                                    str(table.index[i])))]
    return table


def _first(key: object) -> object:
    return key[0] if isinstance(key, tuple) else key


def flatten(table: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    table = table.copy()
    if isinstance(table.columns, pd.MultiIndex):
        table.columns = [" ".join(f"{n}={v:g}" if isinstance(v, float) else f"{n}={v}" for n, v in zip(names, col))
                         for col in table.columns]
    else:
        table.columns = [f"{names[0]}={c:g}" if isinstance(c, float) else f"{names[0]}={c}" for c in table.columns]
    return table.reset_index()


def what_it_cost(frame: pd.DataFrame, columns: list[str], names: list[str]) -> list[str]:
    """The cells' realized rho and, where the runs measured it, their quality: a latency table
    never stands without what its speed was bought with. Cells of an approximate method that
    reused nothing are flagged (their latency is NonShared's plus overhead)."""
    lines = ["### realized rho (shared tokens served by reuse / reusable)", "",
             flatten(pivot(frame, ["method_config"], columns, "realized_rho", 2), names).to_markdown(index=False), ""]
    quality = [("exact_match_rate", "exact match with the NonShared reference"), ("output_pgr", "output PGR"),
               ("pgr", "task PGR"), ("task_accuracy", "task accuracy")]
    for metric, label in quality:
        if metric in frame and frame[metric].notna().any():
            table = flatten(pivot(frame, ["method_config"], columns, metric, 3), names)
            lines += [f"### {label}", "", table.to_markdown(index=False), ""]
    if not any(m in frame and frame[m].notna().any() for m, _ in quality):
        lines += ["No run here was compared with a NonShared reference (`kvbench quality`) or scored on a task: "
                  "these latencies say what the methods save, not what they cost in outputs.", ""]
    if "saturated" in frame and (frame["saturated"] > 0).any():
        stopped = frame[frame["saturated"] > 0]
        cells = "; ".join(f"{r.method_config} ctx={r.shared_tokens} qps={r.qps:g}" for r in stopped.itertuples())
        lines += [f"**Saturated** (marked `(sat.)`): {cells} stopped early, backlog and TTFT growing without bound; "
                  "their figures describe a growing queue, not a steady state at that QPS.", ""]
    idle = frame[(frame["method"] != "nonshared") & ~(frame["realized_rho"] > 0)]
    if len(idle):
        cells = "; ".join(f"{r.method_config} ctx={r.shared_tokens} qps={r.qps:g}" for r in idle.itertuples())
        lines += [f"**Reused nothing** (realized rho 0 or unknown; every shared token computed): {cells}.", ""]
    return lines


def peak_memory(frame: pd.DataFrame) -> pd.Series:
    """Each row's peak memory (GiB) as the paper counts it: a GPU's peak, else the CPU twin from
    tensors (analysis/device_memory.py); NaN where the run reported neither."""
    nan = pd.Series(float("nan"), index=frame.index)
    return frame.get("peak_gpu_memory_gib", nan).fillna(frame.get("peak_cpu_tensor_memory_gib", nan))


def context_label(tokens: int) -> str:
    """2048 -> 2K, as the paper labels shared contexts."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens / 1024:g}K"
