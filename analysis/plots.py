"""PNG plots of recorded runs (matplotlib/seaborn; headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from kvbench import run_files
from kvbench.analysis.runs import Run

# One colour per method in every plot (the registry's built-in methods first, in a fixed order; any
# other by its name), so that NonShared is the same colour in every figure of every report.
KNOWN_METHODS = ("nonshared", "fullshared", "kvcmas", "cacheblend", "droidspeak", "relaycaching", "graphflow", "kvcomm",
                 "polykv", "kvcmas-nonchained", "kvcomm-ref", "precache-prelr", "precache-rebase")


def method_color(method: str) -> tuple[float, float, float]:
    palette = sns.color_palette("tab20", 20)
    if method in KNOWN_METHODS:
        return palette[(2 * KNOWN_METHODS.index(method)) % 20]  # the darker shade of each pair first
    return palette[sum(map(ord, method)) % 20]


def _method_of(run_name: str, table: pd.DataFrame) -> str:
    rows = table.loc[table["run"] == run_name, "method"]
    return str(rows.iloc[0]) if len(rows) else run_name.split()[0]


def ttft_cdf(runs: list[Run], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ok = run.requests[run.requests["success"]]["ttft_ms"].sort_values()
        if len(ok):  # a method's second run (the A/A arm) dashed, in its method's colour
            ax.plot(ok.to_numpy(), [(i + 1) / len(ok) for i in range(len(ok))], label=run.name,
                    color=method_color(run.method), linestyle="--" if run.is_noise_floor else "-")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT distribution per run")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ttft_percentiles(table: pd.DataFrame, path: Path) -> Path:
    """p50 TTFT as a bar in its method's colour, p90 as a black tick above it."""
    runs = len(table)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * runs + 2), 5))
    x = range(runs)
    bars = ax.bar(x, table["p50_ttft_ms"], color=[method_color(m) for m in table["method"]], label="p50")
    ax.scatter(x, table["p90_ttft_ms"], marker="_", s=400, color="black", label="p90", zorder=3)
    ax.set_xticks(list(x), list(table["run"]))
    ax.set(title="p50 (bar) and p90 (tick) TTFT per run (successful requests)", xlabel="", ylabel="TTFT (ms)")
    ax.legend()
    # Run names are whole grid cells (method, context, QPS): slanted so they never overprint.
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    ax.bar_label(bars, fmt="%.0f", fontsize=7, rotation=90 if runs > 6 else 0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ttft_by_agent_plot(by_agent: pd.DataFrame, path: Path, table: pd.DataFrame | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = [method_color(_method_of(str(c), table)) for c in by_agent.columns] if table is not None else None
    by_agent.plot(kind="bar", ax=ax, rot=0, color=colors)
    ax.set(title="p50 TTFT by agent position", xlabel="agent (workflow order)", ylabel="TTFT (ms)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def memory_plot(table: pd.DataFrame, path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(11, 4))
    for ax, column, title in zip(axes, ["method_state_mib", "peak_server_rss_mib", "peak_kv_cache_usage_perc"],
                                 ["method state (MiB)", "server peak RSS (MiB)", "peak vLLM KV usage (share of its pool)"]):
        ax.bar(range(len(table)), table[column].fillna(0), color=[method_color(m) for m in table["method"]])
        ax.set_xticks(range(len(table)), list(table["run"]), ha="right")
        ax.set(title=title, xlabel="", ylabel="")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def speed_quality_plot(table: pd.DataFrame, path: Path) -> Path | None:
    """p50 TTFT against quality per run (PGR with its interval where measured, else exact match
    with the reference): the Pareto picture, one panel per context length, a colour per method and
    a marker per QPS (a sweep has too many cells for one label each). None when no run here has a
    quality figure."""
    metric = next((m for m in ("pgr", "output_pgr", "exact_match_rate") if table[m].notna().any()), None)
    if metric is None:
        return None
    # PGR's floor is a line at 0, not a method's point (its TTFT is that of no context at all)
    measured = table[table[metric].notna() & ~table["run"].astype(str).str.startswith(run_files.FLOOR_LABEL)]
    contexts = sorted(measured["shared_tokens"].dropna().unique()) or [None]
    methods = sorted(measured["method"].unique())
    colors = {m: method_color(m) for m in methods}
    rates = sorted(measured["qps"].dropna().unique())
    markers = dict(zip(rates, "os^Dvp*hX"))
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts) + 2.5, 4.5), squeeze=False, sharey=True)
    for ax, context in zip(axes[0], contexts):
        cells = measured if context is None else measured[measured["shared_tokens"] == context]
        for row in cells.itertuples():
            value = getattr(row, metric)
            yerr = None
            low, high = getattr(row, f"{metric}_low", None), getattr(row, f"{metric}_high", None)
            if metric != "exact_match_rate" and pd.notna(low) and pd.notna(high):
                yerr = [[max(0.0, value - low)], [max(0.0, high - value)]]
            ax.errorbar([row.p50_ttft_ms], [value], yerr=yerr, marker=markers.get(row.qps, "o"), capsize=3,
                        color=colors[row.method], alpha=0.85)
        if metric != "exact_match_rate":  # the paper's Fig. 4: what naive reuse loses, between it and dense
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
            naive = cells[cells["method"] == "fullshared"][metric]
            if len(naive):
                ax.axhspan(float(naive.min()), 1.0, color="tab:orange", alpha=0.08, linewidth=0)
        ax.set(xlabel="p50 TTFT (ms)", title=f"{int(context)} shared tokens" if context is not None else "")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel({"pgr": "PGR over the task (1: as NonShared, 0: no context)",
                           "output_pgr": "output PGR, token F1 (1: as NonShared, 0: no context)"}.get(
                              metric, "exact match with the NonShared reference"))
    handles = [Line2D([], [], color=colors[m], marker="o", linestyle="", label=m) for m in methods]
    if metric != "exact_match_rate":
        handles += [Line2D([], [], color="black", linewidth=0.8, linestyle="--", label="NonShared (PGR 1)"),
                    Line2D([], [], color="grey", linewidth=0.8, linestyle=":", label="no context (PGR 0)"),
                    Patch(color="tab:orange", alpha=0.2, label="FullShared to NonShared")]
    if len(rates) > 1:
        handles += [Line2D([], [], color="black", markerfacecolor="none", marker=markers[r], linestyle="",
                           label=f"QPS {r:g}") for r in rates]
    fig.legend(handles=handles, loc="center right", fontsize=8)
    fig.suptitle("What each method saves against what it costs")
    fig.tight_layout(rect=(0, 0, 1 - 2.2 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
