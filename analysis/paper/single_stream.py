"""The paper's single-stream efficiency tables and figures (Appendix C): Tables 11 and 12 and Fig.
12 (memory, reuse TTFT and throughput by shared context), Table 13 (anchor-pool capacity V), Fig.
13 (the ranks r_C and r_Delta), Tables 14 and 15 (agents and rounds)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.analysis.aggregate import method_params
from kvbench.analysis.paper.accuracy import accuracy_cell, benchmark_rows, provenance
from kvbench.analysis.paper.format import (
    context_label,
    flatten,
    fmt,
    in_paper_order,
    paper_number,
    paper_section,
    peak_memory,
    pivot,
)
from kvbench.analysis.paper.methods import METHOD_NAMES, paper_name
from kvbench.analysis.paper.serving import protocol_caption
from kvbench.analysis.paper.values_efficiency import (
    ESTIMATED,
    RHO_COLUMNS,
    SCALING_STEPS,
    table11_values,
    table12_values,
    table13_values,
    table14_values,
    table15_values,
)

# What a single-stream table reports about memory on this machine (the paper's is peak GPU memory).
MEMORY_METRICS = [("peak_gpu_memory_gib", "peak GPU memory (GiB; the paper's measure, in GB)", 2),
                  ("peak_cpu_tensor_memory_gib", "CPU twin of peak memory: weights + KV pool + store + method state "
                   "(GiB, from their tensors; no temporary buffers)", 3),
                  ("method_state_mib", "method state (MiB)", 1), ("peak_server_rss_mib", "server peak RSS (MiB)", 0),
                  ("peak_kv_usage_pct", "peak vLLM KV usage (%)", 2)]


def _measured(frame: pd.DataFrame, metrics: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The metrics some run of `frame` reported (a GPU's peak or the CPU twin, not both)."""
    return [m for m in metrics if m[0] in frame and frame[m[0]].notna().any()]


def _single(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["qps"] == 0]


def _paper_by_rho(values: Callable[[str, int, float], float | None], digits: int, thousands: bool = False,
                  mark_estimated: bool = False) -> pd.DataFrame:
    """Tables 11 / 12's layout: rows (shared context, method) in the paper's order, columns rho."""
    rows = []
    for context in (2048, 8192, 32768):
        for method in METHOD_NAMES.values():
            cells = {f"rho={rho:g}": values(method, context, rho) for rho in RHO_COLUMNS}
            if all(v is None for v in cells.values()):
                continue
            name = paper_name(method) + ("†" if mark_estimated and method in ESTIMATED else "")
            rows.append({"shared": context_label(context), "method": name,
                         **{k: paper_number(v, digits, thousands) for k, v in cells.items()}})
    return pd.DataFrame(rows)


def render_single_stream(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    """Tables 11 and 12 (and Fig. 12's bars): one sweep, single stream, by shared context."""
    single = in_paper_order(_single(frame))
    if single.empty:
        return "No single-stream runs (QPS 0) in these results: this table needs them."
    lines = ["Single stream. TTFT averaged over reuse requests (turns with a reusable source), throughput = "
             "trajectory tokens / trajectory E2E; memory figures kept apart (vLLM pre-allocates its KV pool).", "",
             *protocol_caption(single)]
    for metric, label, digits in [("reuse_ttft_s", "reuse-request TTFT (s)", 3),
                                  ("throughput_tok_s", "trajectory throughput (tokens/s)", 0),
                                  *_measured(single, MEMORY_METRICS),
                                  ("realized_rho", "realized rho", 3)]:
        table = flatten(pivot(single, ["method_config"], ["shared_tokens"], metric, digits), ["ctx"])
        lines += [f"### {label}", "", table.to_markdown(index=False), ""]
    if with_paper:
        memory, speed = table11_values(), table12_values()
        lines += paper_section("peak GPU memory (GB), Table 11 (Llama-3.1-8B, A6000 48 GB; † estimated, it did not "
                               "fit)", _paper_by_rho(lambda m, c, r: memory.get((m, c, r)), 1, mark_estimated=True))
        ttft = _paper_by_rho(lambda m, c, r: speed.get((m, c, "ttft_s", r)), 2)
        throughput = _paper_by_rho(lambda m, c, r: speed.get((m, c, "throughput_tok_s", r)), 0, thousands=True)
        lines += paper_section("reuse-request TTFT (s), then trajectory throughput (tokens/s), Table 12", ttft.merge(
            throughput, on=["shared", "method"], suffixes=(" TTFT", " throughput")))
        lines += ["The paper's columns are reuse ratios it set each method to; ours are at the realized rho above.",
                  ""]
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


def render_scaling(dimension: str, label: str, table_name: str,
                   values: Callable[[], dict]) -> Callable[[pd.DataFrame, Path, bool], str]:
    """Tables 14 (agents N) and 15 (rounds R)."""
    def render(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
        single = in_paper_order(_single(frame))
        lines = [f"Single stream by {label}: TTFT averaged over all agent requests, trajectory throughput, memory.",
                 "", *protocol_caption(single)]
        for metric, title, digits in [("mean_ttft_s", "TTFT (s)", 3), ("throughput_tok_s", "throughput (tokens/s)", 0),
                                      *_measured(single, MEMORY_METRICS), ("realized_rho", "realized rho", 3)]:
            table = flatten(pivot(single, ["method_config"], [dimension], metric, digits), [label])
            lines += [f"### {title}", "", table.to_markdown(index=False), ""]
        if with_paper:
            paper = values()
            rows = [{"method": paper_name(m),
                     **{f"{title} {label}={step}": paper_number(paper[(m, metric, step)], digits, thousands)
                        for metric, title, digits, thousands in (("ttft_s", "TTFT (s)", 2, False),
                                                                 ("throughput_tok_s", "throughput", 0, True),
                                                                 ("memory_gb", "memory (GB)", 2, False))
                        for step in SCALING_STEPS}}
                    for m in METHOD_NAMES.values() if (m, "ttft_s", SCALING_STEPS[0]) in paper]
            lines += paper_section(f"{table_name} (32K shared tokens, Llama-3.1-8B, A6000 48 GB; selective "
                                   "recomputation at rho 0.9, delta correction at 0.8)", pd.DataFrame(rows))
        return "\n".join(lines)
    return render


render_table14 = render_scaling("agents", "N", "Table 14", table14_values)
render_table15 = render_scaling("rounds", "R", "Table 15", table15_values)


def render_table13(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    single = frame[(frame["qps"] == 0) & (frame["task"] == "none")].set_index("method_config")
    accuracy = benchmark_rows(frame)
    accuracy = accuracy[accuracy["task"] == "mmlu"].set_index("method_config")
    table = pd.DataFrame({
        "V": [json.loads(p).get("V") for p in single["method_params"]],
        "TTFT (s)": [fmt(v, c, 3) for v, c in zip(single["mean_ttft_s"], single["mean_ttft_s_ci"])],
        "throughput (tok/s)": [fmt(v, c, 0) for v, c in zip(single["throughput_tok_s"], single["throughput_tok_s_ci"])],
        "method state (MiB)": [fmt(v, c, 1) for v, c in zip(single["method_state_mib"], single["method_state_mib_ci"])],
        "peak memory (GiB)": [fmt(v, None, 2) for v in peak_memory(single)],  # a GPU's peak, else the CPU twin
        "realized rho": [fmt(v, None, 3) for v in single["realized_rho"]],
    }, index=single.index).sort_values("V")
    notes: list[str] = []
    if len(accuracy):  # the accuracy sweep (`--data mmlu=PATH`): its own rho, on MMLU's workload
        table["MMLU accuracy (%) [95%]"] = [accuracy_cell(accuracy.loc[c]) if c in accuracy.index else "–"
                                            for c in table.index]
        table["MMLU rho"] = [fmt(accuracy.loc[c, "realized_rho"], None, 3) if c in accuracy.index else "–"
                             for c in table.index]
        notes = provenance(accuracy.reset_index())
    lines = ["Single stream by anchor-pool capacity V.", "", *protocol_caption(single.reset_index()),
             table.reset_index().to_markdown(index=False), "", *notes]
    if with_paper:
        paper = table13_values()
        rows = [{"V": str(v), "TTFT (s)": paper_number(paper[(v, "ttft_s")], 2),
                 "throughput": paper_number(paper[(v, "throughput_tok_s")], 0, True),
                 "memory (GB)": paper_number(paper[(v, "memory_gb")], 2),
                 "MMLU": paper_number(paper[(v, "mmlu_accuracy")], 2),
                 "Video-MME": paper_number(paper[(v, "video_mme_accuracy")], 2)}
                for v in sorted({v for v, _ in paper})]
        lines += paper_section("Table 13 (32K shared tokens, three agents, r = 32, rho 0.8; A6000 48 GB)",
                               pd.DataFrame(rows))
    return "\n".join(lines)


def render_fig13(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    """Fig. 13: KVCMAS's ranks (r_C, r_Delta) against single-stream TTFT, throughput and memory
    (and MMLU accuracy where an accuracy sweep ran). The paper gives this figure no numbers."""
    kvcmas = frame[(frame["method"] == "kvcmas") & (frame["qps"] == 0)]
    if kvcmas.empty:
        return "No single-stream kvcmas runs here: `--methods kvcmas --method-param kvcmas:r_c=16,32,64`."
    ranks = [(method_params(r).get("r_c", 32), method_params(r).get("r_delta", 32)) for _, r in kvcmas.iterrows()]
    kvcmas = kvcmas.assign(ranks=[f"({c}, {d})" for c, d in ranks], r_c=[c for c, _ in ranks],
                           r_delta=[d for _, d in ranks]).sort_values(["r_c", "r_delta"])
    speed = kvcmas[kvcmas["task"] == "none"]
    accuracy = benchmark_rows(kvcmas)
    table = pd.DataFrame({"configuration": speed["method_config"], "(r_C, r_Delta)": speed["ranks"],
                          "TTFT (s)": [fmt(v, c, 3) for v, c in zip(speed["mean_ttft_s"], speed["mean_ttft_s_ci"])],
                          "throughput (tok/s)": [fmt(v, c, 0) for v, c in
                                                 zip(speed["throughput_tok_s"], speed["throughput_tok_s_ci"])],
                          "method state (MiB)": [fmt(v, c, 1) for v, c in
                                                 zip(speed["method_state_mib"], speed["method_state_mib_ci"])],
                          "realized rho": [fmt(v, None, 3) for v in speed["realized_rho"]]})
    lines = ["KVCMAS's base-cache and correction ranks, single stream. The paper plots this figure without printing "
             "its numbers: nothing of the paper's is shown beside ours.", "", *protocol_caption(speed),
             table.to_markdown(index=False), ""]
    if len(accuracy):
        lines += ["### MMLU accuracy (%) [95%]", "", pd.DataFrame(
            {"(r_C, r_Delta)": accuracy["ranks"], "accuracy": [accuracy_cell(r) for _, r in accuracy.iterrows()],
             "rho": [fmt(v, None, 3) for v in accuracy["realized_rho"]]}).to_markdown(index=False), "",
                  *provenance(accuracy)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (metric, title) in zip(axes, [("mean_ttft_s", "TTFT (s)"), ("throughput_tok_s", "throughput (tok/s)"),
                                          ("method_state_mib", "method state (MiB)")]):
        ax.bar(speed["ranks"], speed[metric])
        ax.set(title=title, xlabel="(r_C, r_Delta)")
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle("KVCMAS ranks, single stream (cf. paper Fig. 13)")
    fig.tight_layout()
    fig.savefig(out / "fig13.png", dpi=120)
    plt.close(fig)
    return "\n".join(lines + ["![Fig. 13](fig13.png)"])
