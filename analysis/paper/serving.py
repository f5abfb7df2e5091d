"""The paper's serving tables and figures under concurrent load (Appendix B.4-B.6): Table 7 and
Figs 5 and 8 (TTFT by shared context and QPS), Table 9 and Figs 6 and 9 (chained against
non-chained KVCMAS), Table 10 and Figs 10 and 11 (long agent outputs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from kvbench.analysis.paper.format import (
    context_label,
    flatten,
    paper_number,
    paper_section,
    pivot,
    what_it_cost,
)
from kvbench.analysis.paper.methods import METHOD_NAMES, paper_name
from kvbench.analysis.paper.values_serving import (
    FIG5_PAIRS,
    NO_RHO,
    QPS,
    RHOS,
    TABLE9_METHODS,
    TABLE10_OUTPUT_LENS,
    paired_rho,
    table7_values,
    table9_values,
    table10_values,
)
from kvbench.replay.protocol import PROTOCOLS

PAPER_TABLE7_RHO = 0.8  # the delta-correction operating point of the paper's headline columns
RHO_GAP = 0.2  # a cell this far from it measures another operating point


def protocol_caption(frame: pd.DataFrame) -> list[str]:
    """Which measurement protocol the cells ran under (replay/protocol.py), in a line."""
    names = sorted(set(frame["protocol"])) if "protocol" in frame else ["free"]
    return [f"Protocol: {name}, {PROTOCOLS[name].caption}." for name in names if name in PROTOCOLS] + [""]


def rho_far_from_paper(frame: pd.DataFrame) -> list[str]:
    """Cells of approximate methods whose realized rho is far from the paper's 0.8: their TTFT is
    at another operating point than the paper's columns printed beside them."""
    approximate = frame[frame["method"] != "nonshared"]
    far = approximate[~((approximate["realized_rho"] - PAPER_TABLE7_RHO).abs() <= RHO_GAP)]
    if not len(far):
        return []
    cells = "; ".join(f"{r.method_config} ctx={r.shared_tokens} qps={r.qps:g} (rho {r.realized_rho:.2f})"
                      for r in far.itertuples())
    return [f"**Not at the paper's operating point** (realized rho more than {RHO_GAP:g} from its "
            f"{PAPER_TABLE7_RHO:g}; `kvbench calibrate --target-rho 0.8` gives a threshold to pass with "
            f"--method-param, warm-ups with --prime-method-state fill the anchor pools): {cells}.", ""]


def _paper_rho_qps(values: dict, sizes: list[int], label: str, size_label: Callable[[int], str]) -> pd.DataFrame:
    """The paper's Table 7 / 10 layout: rows (size, percentile, method) in its order, columns rho x QPS."""
    rows = []
    for size in sizes:
        for pct in ("p50", "p90"):
            for method in METHOD_NAMES.values():
                if (method, size, pct, RHOS[0], QPS[0]) not in values:
                    continue  # KVComm out of memory
                rows.append({label: size_label(size), "pct": pct, "method": paper_name(method),
                             **{f"rho={rho:g} qps={qps:g}": paper_number(values[(method, size, pct, rho, qps)], 2)
                                for rho in RHOS for qps in QPS}})
    return pd.DataFrame(rows)


def render_table7(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    lines = ["p50 and p90 TTFT (s) of every request, by shared context and trajectory QPS.", "",
             *protocol_caption(frame)]
    for pct in ("p50", "p90"):
        table = flatten(pivot(frame, ["method_config"], ["shared_tokens", "qps"], f"{pct}_ttft_s", 3), ["ctx", "qps"])
        lines += [f"### {pct} TTFT (s), this machine", "", table.to_markdown(index=False), ""]
    if with_paper:
        lines += paper_section("TTFT (s), Table 7 (Llama-3.1-8B, A100 80 GB)",
                               _paper_rho_qps(table7_values(), [2048, 8192, 32768], "shared", context_label))
    lines += what_it_cost(frame, ["shared_tokens", "qps"], ["ctx", "qps"])
    if with_paper:
        lines += rho_far_from_paper(frame)
    lines_vs_qps(frame, "p50_ttft_s", "shared_tokens", out / "fig5_p50_ttft.png", "p50 TTFT vs QPS (cf. paper Fig. 5)")
    lines_vs_qps(frame, "p90_ttft_s", "shared_tokens", out / "fig8_p90_ttft.png", "p90 TTFT vs QPS (cf. paper Fig. 8)")
    lines += ["![p50 TTFT vs QPS](fig5_p50_ttft.png)", "", "![p90 TTFT vs QPS](fig8_p90_ttft.png)"]
    if {"kvcmas", "kvcmas-nonchained"} <= set(frame["method"]):
        chained = frame[frame["method"].isin(["kvcmas", "kvcmas-nonchained"])]
        lines_vs_qps(chained, "p50_ttft_s", "shared_tokens", out / "fig6_chained.png",
                     "chained vs non-chained (cf. paper Fig. 6)")
        lines += ["", "![chained vs non-chained](fig6_chained.png)"]
    return "\n".join(lines)


def render_fig5(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    """Fig. 5: p50 TTFT against QPS per shared context, ours in the top row; the paper's two
    rho-paired rows below (selective recomputation at 0.9 with delta correction at 0.8, then 0.8
    with 0.6)."""
    contexts = sorted(set(frame["shared_tokens"]))
    rows = 1 + (len(FIG5_PAIRS) if with_paper else 0)
    fig, axes = plt.subplots(rows, len(contexts), figsize=(5 * len(contexts), 4 * rows), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        _plot_methods(ax, frame[frame["shared_tokens"] == context], "p50_ttft_s")
        ax.set(title=f"this machine, {context_label(context)} shared")
    values = table7_values()
    for row, pair in enumerate(FIG5_PAIRS[: rows - 1], start=1):
        for ax, context in zip(axes[row], contexts):
            for method in METHOD_NAMES.values():
                rho = paired_rho(method, pair)
                points = [(q, values[(method, context, "p50", rho, q)]) for q in QPS
                          if (method, context, "p50", rho, q) in values]
                if points:
                    ax.plot(*zip(*points), marker="o", linestyle="--", label=f"{paper_name(method)} (rho {rho:g})")
            ax.set(title=f"the paper, {context_label(context)}, rho {pair[0]:g} / {pair[1]:g}",
                   xlabel="trajectory QPS", ylabel="p50 TTFT (s)", yscale="log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("p50 TTFT under concurrent serving (cf. paper Fig. 5)")
    fig.tight_layout()
    fig.savefig(out / "fig5.png", dpi=120)
    plt.close(fig)
    table = flatten(pivot(frame, ["method_config"], ["shared_tokens", "qps"], "p50_ttft_s", 3), ["ctx", "qps"])
    lines = ["p50 TTFT (s) against trajectory QPS, by shared context.", "", *protocol_caption(frame),
             "### p50 TTFT (s), this machine", "", table.to_markdown(index=False), ""]
    if with_paper:  # the paper's points at the contexts drawn, as its two rows pair them (its baselines have no rho)
        for pair in FIG5_PAIRS:
            paired = pd.DataFrame([
                {"shared": context_label(c), "method": paper_name(m),
                 "rho": "–" if m in NO_RHO else f"{paired_rho(m, pair):g}",
                 **{f"qps={q:g}": paper_number(values[(m, c, "p50", paired_rho(m, pair), q)], 2) for q in QPS}}
                for c in contexts for m in METHOD_NAMES.values() if (m, c, "p50", paired_rho(m, pair), 0.0) in values])
            if len(paired):
                lines += paper_section(f"p50 TTFT (s), Fig. 5's row at rho {pair[0]:g} / {pair[1]:g} (Table 7)",
                                       paired)
    lines += what_it_cost(frame, ["shared_tokens", "qps"], ["ctx", "qps"])
    return "\n".join(lines + ["![Fig. 5](fig5.png)"])


def render_table9(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    chained = frame[frame["method"].isin(list(TABLE9_METHODS.values()))]
    lines = ["p50 and p90 TTFT (s) of chained (kvcmas) and non-chained (kvcmas-nonchained) KVCMAS, by shared "
             "context and QPS.", "", *protocol_caption(frame)]
    if chained.empty:
        return "\n".join(lines + ["No kvcmas or kvcmas-nonchained runs here: `--methods kvcmas,kvcmas-nonchained`."])
    for pct in ("p50", "p90"):
        table = flatten(pivot(chained, ["method_config", "shared_tokens"], ["qps"], f"{pct}_ttft_s", 3), ["qps"])
        lines += [f"### {pct} TTFT (s), this machine", "", table.to_markdown(index=False), ""]
    if with_paper:
        values, names = table9_values(), {v: k for k, v in TABLE9_METHODS.items()}
        paper = pd.DataFrame([{"pct": pct, "shared": context_label(c), "method": names[m],
                               **{f"qps={q:g}": paper_number(values[(m, c, pct, q)], 2) for q in QPS}}
                              for pct in ("p50", "p90") for c in (2048, 8192, 32768) for m in TABLE9_METHODS.values()])
        lines += paper_section("Table 9, rho 0.8 (Llama-3.1-8B, A100 80 GB)", paper)
    lines += what_it_cost(chained, ["shared_tokens", "qps"], ["ctx", "qps"])
    lines_vs_qps(chained, "p90_ttft_s", "shared_tokens", out / "fig9_chained_p90.png",
                 "chained vs non-chained p90 TTFT (cf. paper Fig. 9)")
    return "\n".join(lines + ["![Fig. 9](fig9_chained_p90.png)"])


def render_table10(frame: pd.DataFrame, out: Path, with_paper: bool) -> str:
    """Table 10 and Figs 10-11: TTFT by the agents' accumulated output (3 x --output-len) over the
    shared context, by QPS."""
    frame = frame.assign(generated_tokens=3 * frame["output_len"])
    lines = ["p50 and p90 TTFT (s) by shared generated context (the final agent reads three agents' outputs: "
             "3 x the output length) and trajectory QPS, over a fixed shared context.", "", *protocol_caption(frame)]
    for pct in ("p50", "p90"):
        table = flatten(pivot(frame, ["method_config"], ["generated_tokens", "qps"], f"{pct}_ttft_s", 3),
                        ["generated", "qps"])
        lines += [f"### {pct} TTFT (s), this machine", "", table.to_markdown(index=False), ""]
    if with_paper:
        lines += paper_section("TTFT (s), Table 10 (2K shared context; 0.375K is Table 7(a))",
                               _paper_rho_qps(table10_values(), [1536, 6144], "generated", lambda n: f"{n / 1024:g}K"))
    lines += what_it_cost(frame, ["generated_tokens", "qps"], ["generated", "qps"])
    for metric, name in (("p50_ttft_s", "fig10"), ("p90_ttft_s", "fig11")):
        lines_vs_qps(frame, metric, "generated_tokens", out / f"{name}.png",
                     f"{metric[:3]} TTFT by shared generated tokens (cf. paper Fig. {name[3:]})")
        lines += [f"![{name}]({name}.png)", ""]
    lines += [f"Per-agent output lengths of the paper's columns: "
              f"{', '.join(f'{g / 1024:g}K = 3 x {n}' for g, n in TABLE10_OUTPUT_LENS.items())}."]
    return "\n".join(lines)


def _plot_methods(ax, frame: pd.DataFrame, metric: str) -> None:
    for name, group in frame.groupby("method_config"):
        group = group.sort_values("qps")
        ax.errorbar(group["qps"], group[metric], yerr=group[f"{metric}_ci"].fillna(0), marker="o", label=name, capsize=3)
    ax.set(xlabel="trajectory QPS (0 = single stream)", ylabel=metric.replace("_s", " (s)"), yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def lines_vs_qps(frame: pd.DataFrame, metric: str, panel: str, path: Path, title: str) -> None:
    """`metric` against QPS, one panel per value of `panel` (shared context, generated tokens)."""
    panels = sorted(set(frame[panel]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, value in zip(axes[0], panels):
        _plot_methods(ax, frame[frame[panel] == value], metric)
        ax.set(title=f"{context_label(int(value))} {'shared' if panel == 'shared_tokens' else 'generated'} tokens")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
