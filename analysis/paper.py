"""The paper's tables and figures, rendered from sweep results (`kvbench paper TABLE`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.analysis import fidelity
from kvbench.analysis.aggregate import average_repeats, runs_frame
from kvbench.analysis.paper_accuracy import (
    accuracy_cell,
    benchmark_rows,
    provenance,
    render_table1,
    render_table5,
    render_table6,
    render_table8,
)
from kvbench.analysis.paper_values import TABLE13_MMLU, table7_values
from kvbench.analysis.runs import find_runs

DEFAULT_METHODS = ["nonshared", "fullshared"]
# The cache-fidelity sweep (Figs 2, 3, 7, Table 2): single stream, prompts kept, anchor pools
# primed; FullShared's cells measure the segments (in NonShared's prompts), every connector
# method's cells what they served.
FIDELITY_GRID = {"shared_tokens": [2048, 8192], "qps": [0.0], "agents": [4],
                 "methods": ["nonshared", "fullshared", "kvcmas", "kvcmas-nonchained"],
                 "save_prompt_ids": True, "prime_method_state": True, "num_trajectories": 4}


@dataclass(frozen=True)
class PaperTable:
    name: str
    title: str
    # The default grid of `kvbench paper NAME --run` (scaled to what a 2-core CPU sustains).
    grid: dict = field(default_factory=dict)
    render: Callable[[pd.DataFrame, Path, bool], str] | None = None
    # Cache-fidelity entries render from the measurements their sweep's cells kept
    # (kvbench.experiment.fidelity), not from the runs' summaries.
    render_measured: Callable[[Path, Path], str] | None = None
    # A second sweep on benchmark workloads for the table's accuracy column, run by `--run` when
    # every benchmark it names has its --data (sweep-accuracy/ beside sweep/).
    accuracy_grid: dict | None = None


def _fmt(value: float, ci: float | None = None, digits: int = 2) -> str:
    if pd.isna(value):
        return "–"
    text = f"{value:.{digits}f}"
    return text + (f" ±{ci:.{digits}f}" if ci is not None and not pd.isna(ci) else "")


def _pivot(frame: pd.DataFrame, rows: list[str], columns: list[str], metric: str, digits: int = 2) -> pd.DataFrame:
    saturated = frame["saturated"] if "saturated" in frame else pd.Series(0.0, index=frame.index)
    cells = frame.assign(cell=[_fmt(v, c, digits) + (" (sat.)" if s > 0 else "")  # stopped over-saturated
                               for v, c, s in zip(frame[metric], frame[f"{metric}_ci"], saturated.fillna(0))])
    return cells.pivot_table(index=rows, columns=columns, values="cell", aggfunc="first")


def _flatten(table: pd.DataFrame, names: list[str]) -> pd.DataFrame:
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
             _flatten(_pivot(frame, ["method_config"], columns, "realized_rho", 2), names).to_markdown(index=False), ""]
    for metric, label in (("exact_match_rate", "exact match with the NonShared reference"),
                          ("output_pgr", "output PGR"), ("pgr", "task PGR"), ("task_accuracy", "task accuracy")):
        if metric in frame and frame[metric].notna().any():
            table = _flatten(_pivot(frame, ["method_config"], columns, metric, 3), names)
            lines += [f"### {label}", "", table.to_markdown(index=False), ""]
    if not any(m in frame and frame[m].notna().any() for m in ("exact_match_rate", "output_pgr", "pgr", "task_accuracy")):
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


PAPER_TABLE7_RHO = 0.8  # the operating point of the paper's Table 7 columns
RHO_GAP = 0.2  # a cell this far from it measures another operating point


def rho_far_from_paper(frame: pd.DataFrame) -> list[str]:
    """Cells of approximate methods whose realized rho is far from the rho of the paper's columns
    printed beside them: their TTFT is at another operating point than the paper's."""
    approximate = frame[frame["method"] != "nonshared"]
    far = approximate[~((approximate["realized_rho"] - PAPER_TABLE7_RHO).abs() <= RHO_GAP)]
    if not len(far):
        return []
    cells = "; ".join(f"{r.method_config} ctx={r.shared_tokens} qps={r.qps:g} (rho {r.realized_rho:.2f})"
                      for r in far.itertuples())
    return [f"**Not at the paper's operating point** (realized rho more than {RHO_GAP:g} from its "
            f"{PAPER_TABLE7_RHO:g}; `kvbench calibrate --target-rho 0.8`, or warm-ups with --prime-method-state): "
            f"{cells}.", ""]


def render_table7(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    lines = ["p50 and p90 TTFT (s) of every request, by shared context and trajectory QPS.", ""]
    for pct in ("p50", "p90"):
        table = _flatten(_pivot(frame, ["method_config"], ["shared_tokens", "qps"], f"{pct}_ttft_s", 3), ["ctx", "qps"])
        lines += [f"### {pct} TTFT (s), this machine", "", table.to_markdown(index=False), ""]
        if with_paper:
            lines += [f"### {pct} TTFT (s), the paper (Llama-3.1-8B, A100; rho = 0.8 columns)", "",
                      _paper_table7(frame, pct).to_markdown(index=False), ""]
    lines += what_it_cost(frame, ["shared_tokens", "qps"], ["ctx", "qps"])
    if with_paper:
        lines += rho_far_from_paper(frame)
    _lines_vs_qps(frame, "p50_ttft_s", out / "fig5_p50_ttft.png", "p50 TTFT vs QPS (cf. paper Fig. 5)")
    _lines_vs_qps(frame, "p90_ttft_s", out / "fig8_p90_ttft.png", "p90 TTFT vs QPS (cf. paper Fig. 8)")
    lines += ["![p50 TTFT vs QPS](fig5_p50_ttft.png)", "", "![p90 TTFT vs QPS](fig8_p90_ttft.png)"]
    if {"kvcmas", "kvcmas-nonchained"} <= set(frame["method"]):
        chained = frame[frame["method"].isin(["kvcmas", "kvcmas-nonchained"])]
        _lines_vs_qps(chained, "p50_ttft_s", out / "fig6_chained.png", "chained vs non-chained (cf. paper Fig. 6)")
        lines += ["", "![chained vs non-chained](fig6_chained.png)"]
    return "\n".join(lines)


def _paper_table7(frame: pd.DataFrame, pct: str) -> pd.DataFrame:
    values = table7_values()
    rows = []
    for method in sorted(set(frame["method"])):
        row = {"method": method}
        for context in sorted(set(frame["shared_tokens"])):
            for qps in sorted(set(frame["qps"])):
                row[f"ctx={context} qps={qps:g}"] = _fmt(values.get((method, context, pct, 0.8, qps), float("nan")))
        rows.append(row)
    return pd.DataFrame(rows)


def _lines_vs_qps(frame: pd.DataFrame, metric: str, path: Path, title: str) -> None:
    contexts = sorted(set(frame["shared_tokens"]))
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for name, group in frame[frame["shared_tokens"] == context].groupby("method_config"):
            group = group.sort_values("qps")
            ax.errorbar(group["qps"], group[metric], yerr=group[f"{metric}_ci"].fillna(0), marker="o", label=name,
                        capsize=3)
        ax.set(title=f"{context // 1024}K shared tokens", xlabel="trajectory QPS (0 = single stream)",
               ylabel=metric.replace("_s", " (s)"))
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_single_stream(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    single = frame[frame["qps"] == 0]
    if single.empty:
        return "No single-stream runs (QPS 0) in these results: this table needs them."
    lines = ["Single stream. TTFT averaged over reuse requests (turns with a reusable source), throughput = "
             "trajectory tokens / trajectory E2E; memory figures kept apart (vLLM pre-allocates its KV pool).", ""]
    for metric, label, digits in [("reuse_ttft_s", "reuse-request TTFT (s)", 3),
                                  ("throughput_tok_s", "trajectory throughput (tokens/s)", 0),
                                  ("method_state_mib", "method state (MiB)", 1), ("peak_rss_mib", "server peak RSS (MiB)", 0),
                                  ("peak_kv_usage_pct", "peak vLLM KV usage (%)", 2)]:
        table = _flatten(_pivot(single, ["method_config"], ["shared_tokens"], metric, digits), ["ctx"])
        lines += [f"### {label}", "", table.to_markdown(index=False), ""]
    _bars(single, out / "fig12_single_stream.png")
    return "\n".join(lines + ["![single stream](fig12_single_stream.png)"])


def _bars(frame: pd.DataFrame, path: Path) -> None:
    metrics = [("reuse_ttft_s", "reuse TTFT (s)"), ("throughput_tok_s", "throughput (tok/s)"),
               ("method_state_mib", "method state (MiB)")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (metric, label) in zip(axes, metrics):
        frame.pivot_table(index="shared_tokens", columns="method_config", values=metric).plot(kind="bar", ax=ax, rot=0)
        ax.set(title=label, xlabel="shared tokens")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Single-stream efficiency (cf. paper Fig. 12)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _render_scaling(dimension: str, label: str) -> Callable[[pd.DataFrame, Path, bool], str]:
    def render(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
        single = frame[frame["qps"] == 0]
        lines = [f"Single stream by {label}: TTFT averaged over all agent requests, trajectory throughput, memory.", ""]
        for metric, title, digits in [("mean_ttft_s", "TTFT (s)", 3), ("throughput_tok_s", "throughput (tokens/s)", 0),
                                      ("method_state_mib", "method state (MiB)", 1),
                                      ("peak_rss_mib", "server peak RSS (MiB)", 0)]:
            table = _flatten(_pivot(single, ["method_config"], [dimension], metric, digits), [label])
            lines += [f"### {title}", "", table.to_markdown(index=False), ""]
        return "\n".join(lines)
    return render


def render_table13(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    single = frame[(frame["qps"] == 0) & (frame["task"] == "none")].set_index("method_config")
    accuracy = benchmark_rows(frame)
    accuracy = accuracy[accuracy["task"] == "mmlu"].set_index("method_config")
    table = pd.DataFrame({
        "TTFT (s)": [_fmt(v, c, 3) for v, c in zip(single["mean_ttft_s"], single["mean_ttft_s_ci"])],
        "throughput (tok/s)": [_fmt(v, c, 0) for v, c in zip(single["throughput_tok_s"], single["throughput_tok_s_ci"])],
        "method state (MiB)": [_fmt(v, c, 1) for v, c in zip(single["method_state_mib"], single["method_state_mib_ci"])],
        "realized rho": [_fmt(v, None, 3) for v in single["realized_rho"]],
    }, index=single.index)
    notes = ""
    if len(accuracy):  # the accuracy sweep (`--data mmlu=PATH`): its own rho, on MMLU's workload
        table["MMLU accuracy (%) [95%]"] = [accuracy_cell(accuracy.loc[c]) if c in accuracy.index else "–"
                                            for c in table.index]
        table["MMLU rho"] = [_fmt(accuracy.loc[c, "realized_rho"], None, 3) if c in accuracy.index else "–"
                             for c in table.index]
        notes = "\n\n" + "\n".join(provenance(accuracy.reset_index()))
    if with_paper:
        table["paper MMLU accuracy"] = [_fmt(TABLE13_MMLU.get(int(v), float("nan")), None, 2) if v else "–"
                                        for v in (json.loads(p).get("V") for p in single["method_params"])]
    return "Single stream by anchor-pool capacity V.\n\n" + table.reset_index().to_markdown(index=False) + notes


# Table 1: the paper's workflow on benchmark items, three methods; `--limit` items per task.
# The paper measured at 1 QPS (its accuracy does not depend on it); `--qps 0` runs single stream.
TABLE1_GRID = {"benchmarks": ["mmlu", "gsm8k", "humaneval"], "qps": [1.0],
               "methods": ["nonshared", "fullshared", "kvcmas"], "num_trajectories": 20}

# The accuracy ablations (Tables 6, 8 and 13's column) run on MMLU, as the paper's LLM columns do.
MMLU_GRID = {"benchmarks": ["mmlu"], "qps": [1.0], "num_trajectories": 20}

TABLES: dict[str, PaperTable] = {t.name: t for t in [
    PaperTable("table1", "Table 1: task accuracy, latency, memory and rho on MMLU, GSM8K and HumanEval",
               TABLE1_GRID, render_table1),
    PaperTable("table5", "Table 5: run-to-run spread of accuracy", {**TABLE1_GRID, "repeats": 3}, render_table5),
    PaperTable("table6", "Table 6: KVCMAS's threshold tau against accuracy and rho (MMLU)",
               {**MMLU_GRID, "methods": ["kvcmas"],
                "method_params": {"kvcmas": {"tau": [0.1, 0.2, 0.25, 0.27, 0.29, 0.3, 0.31, 0.33, 0.35, 0.4]}}},
               render_table6),
    PaperTable("table8", "Table 8: chained against non-chained KVCMAS accuracy (MMLU)",
               {**MMLU_GRID, "methods": ["kvcmas", "kvcmas-nonchained"]}, render_table8),
    PaperTable("table7", "Table 7: p50/p90 TTFT under concurrent serving",
               {"shared_tokens": [2048, 8192], "qps": [0.0, 0.25, 0.5, 1.0], "agents": [4]}, render_table7),
    PaperTable("table11", "Table 11: peak memory, single stream",
               {"shared_tokens": [2048, 8192], "qps": [0.0], "agents": [3]}, render_single_stream),
    PaperTable("table12", "Table 12: single-stream reuse TTFT and throughput",
               {"shared_tokens": [2048, 8192], "qps": [0.0], "agents": [3]}, render_single_stream),
    PaperTable("table13", "Table 13: anchor-pool capacity V",
               {"shared_tokens": [8192], "qps": [0.0], "agents": [3], "methods": ["kvcmas"],
                "method_params": {"kvcmas": {"V": [1, 5, 10, 20]}}}, render_table13,
               accuracy_grid={**MMLU_GRID, "methods": ["kvcmas"], "method_params": {"kvcmas": {"V": [1, 5, 10, 20]}}}),
    PaperTable("table14", "Table 14: scaling with the number of agents",
               {"shared_tokens": [2048], "qps": [0.0], "agents": [2, 4, 8]}, _render_scaling("agents", "N")),
    PaperTable("table15", "Table 15: scaling with the number of rounds",
               {"shared_tokens": [2048], "qps": [0.0], "agents": [3], "rounds": [2, 4, 8]},
               _render_scaling("rounds", "R")),
    *[PaperTable(name, title, FIDELITY_GRID, render_measured=renderer) for name, title, renderer in (
        ("fig2", "Fig 2: effective rank of base caches and cross-agent corrections", fidelity.render_fig2),
        ("fig3", "Fig 3: KV error of chained and non-chained correction, by layer and by agent", fidelity.render_fig3),
        ("table2", "Table 2: reconstruction coverage of selective recomputation", fidelity.render_table2),
        ("fig7", "Fig 7: effective rank of PF-induced and PH-induced corrections", fidelity.render_fig7))],
]}
FIDELITY_TABLES = [name for name, table in TABLES.items() if table.render_measured is not None]


def render(name: str, results: Path, out: Path, with_paper: bool = True) -> Path:
    table = TABLES[name]
    out.mkdir(parents=True, exist_ok=True)
    if table.render_measured is not None:
        body = table.render_measured(results, out)
        path = out / f"{name}.md"
        path.write_text(f"# {table.title}\n\nFrom `{results}`.\n\n{body}\n")
        return path
    frame = average_repeats(runs_frame([r for r in find_runs([results]) if not r.is_quality_baseline]))
    frame.to_csv(out / f"{name}.csv", index=False)
    assert table.render is not None
    body = table.render(frame, out, with_paper)
    path = out / f"{name}.md"
    path.write_text(f"# {table.title}\n\nFrom `{results}`.\n\n{body}\n")
    return path
