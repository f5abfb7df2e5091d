"""The paper's tables and figures, rendered from sweep results (`kvbench paper NAME`): the registry
of every artifact with numbers, the grid `--run` sweeps for it (the paper's; CPU runs pass smaller
ones) and the protocol it is measured under (replay/protocol.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvbench.analysis.aggregate import average_repeats, runs_frame
from kvbench.analysis.paper import fidelity
from kvbench.analysis.paper.accuracy import (
    render_fig4,
    render_table1,
    render_table4,
    render_table5,
    render_table6,
    render_table8,
)
from kvbench.analysis.paper.format import paper_number, paper_section
from kvbench.analysis.paper.serving import render_fig5, render_table7, render_table9, render_table10
from kvbench.analysis.paper.single_stream import (
    render_fig13,
    render_single_stream,
    render_table13,
    render_table14,
    render_table15,
)
from kvbench.analysis.paper.values import TABLE2_CRITERIA, TABLE2_MODELS, table2_values
from kvbench.analysis.runs import find_runs

PAPER_METHODS = ["nonshared", "fullshared", "droidspeak", "cacheblend", "relaycaching", "graphflow", "kvcomm", "kvcmas"]
PAPER_CONTEXTS = [2048, 8192, 32768]
PAPER_QPS = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
# The cache-fidelity sweep (Figs 2, 3, 7, Table 2): single stream, prompts kept, anchor pools
# primed; FullShared's cells measure the segments (in NonShared's prompts), every connector
# method's cells what they served.
FIDELITY_GRID = {"shared_tokens": [2048, 8192], "qps": [0.0], "agents": [4],
                 "methods": ["nonshared", "fullshared", "kvcmas", "kvcmas-nonchained"],
                 "save_prompt_ids": True, "prime_method_state": True, "num_trajectories": 4}
# Appendix B.4: four agents, 128-token outputs, 2K-32K shared context, QPS 0-8.
SERVING_GRID = {"shared_tokens": PAPER_CONTEXTS, "qps": PAPER_QPS, "agents": [4], "methods": PAPER_METHODS}
# Appendix C.1: single stream, three agents (C.4/C.5 and C.2/C.3 at 32K).
SINGLE_GRID = {"shared_tokens": PAPER_CONTEXTS, "qps": [0.0], "agents": [3], "methods": PAPER_METHODS}
SINGLE_32K = {**SINGLE_GRID, "shared_tokens": [32768]}
# Table 1: the paper's workflow on benchmark items; `--limit` items per task. The paper measured
# at 1 QPS (its accuracy does not depend on it); `--qps 0` runs single stream.
TABLE1_GRID = {"benchmarks": ["mmlu", "gsm8k", "humaneval"], "qps": [1.0], "methods": PAPER_METHODS,
               "num_trajectories": 20}
# The accuracy ablations (Tables 6, 8 and 13's column) run on MMLU, as the paper's LLM columns do.
MMLU_GRID = {"benchmarks": ["mmlu"], "qps": [1.0], "num_trajectories": 20}
RANKS = {"kvcmas": {"r_c": [16, 32, 64], "r_delta": [16, 32, 64]}}


@dataclass(frozen=True)
class PaperTable:
    name: str
    title: str
    # The default grid of `kvbench paper NAME --run`: the paper's (a CPU passes smaller ones).
    grid: dict = field(default_factory=dict)
    render: Callable[[pd.DataFrame, Path, bool], str] | None = None
    # Cache-fidelity entries render from the measurements their sweep's cells kept
    # (kvbench.experiment.fidelity), not from the runs' summaries.
    render_measured: Callable[[Path, Path], str] | None = None
    # A second sweep on benchmark workloads for the table's accuracy column, run by `--run` when
    # every benchmark it names has its --data (sweep-accuracy/ beside sweep/).
    accuracy_grid: dict | None = None
    # The measurement protocol `--run` uses unless --protocol says otherwise (replay/protocol.py).
    protocol: str = "free"
    # One sweep per per-agent output length (Table 10: sweep-out128/ ...); empty: one sweep.
    output_lens: tuple[int, ...] = ()


def _render_table2(results: Path, out: Path) -> str:
    return fidelity.render_table2(results, out) + "\n" + "\n".join(table2_paper_lines())


def table2_paper_lines() -> list[str]:
    paper = table2_values()
    table = pd.DataFrame([{"dataset / model": f"{task} {model}",
                           **{f"{criterion} {kind.replace('_', ' ')}":
                              paper_number(paper[(task, criterion, kind)], 2) + ("×" if kind != "coverage" else "")
                              for criterion in TABLE2_CRITERIA for kind in ("coverage", "relative_coverage")}}
                          for task, model in TABLE2_MODELS.items()])
    return paper_section("Table 2 (LLM rows; rho 0.9)", table)


TABLE10 = {**SERVING_GRID, "shared_tokens": [2048]}
TABLES: dict[str, PaperTable] = {t.name: t for t in [
    PaperTable("table1", "Table 1: task accuracy, latency, memory and rho on MMLU, GSM8K and HumanEval",
               TABLE1_GRID, render_table1),
    PaperTable("table4", "Table 4: trajectory lengths of the accuracy evaluation", TABLE1_GRID, render_table4),
    PaperTable("fig4", "Fig 4: accuracy against latency", TABLE1_GRID, render_fig4),
    PaperTable("table5", "Table 5: run-to-run spread of accuracy", {**TABLE1_GRID, "repeats": 3}, render_table5),
    PaperTable("table6", "Table 6: KVCMAS's threshold tau against accuracy and rho (MMLU)",
               {**MMLU_GRID, "methods": ["kvcmas"],
                "method_params": {"kvcmas": {"tau": [0.1, 0.2, 0.25, 0.27, 0.29, 0.3, 0.31, 0.33, 0.35, 0.4]}}},
               render_table6),
    PaperTable("table7", "Table 7: p50/p90 TTFT under concurrent serving", SERVING_GRID, render_table7,
               protocol="paper"),
    PaperTable("fig5", "Fig 5: p50 TTFT under concurrent serving, rho-paired", SERVING_GRID, render_fig5,
               protocol="paper"),
    PaperTable("fig8", "Fig 8: p90 TTFT under concurrent serving (with Table 7)", SERVING_GRID, render_table7,
               protocol="paper"),
    PaperTable("fig6", "Fig 6: chained against non-chained KVCMAS, p50 TTFT (with Table 7)",
               {**SERVING_GRID, "methods": ["kvcmas", "kvcmas-nonchained"], "target_rhos": [0.8]}, render_table7,
               protocol="paper"),
    PaperTable("table8", "Table 8: chained against non-chained KVCMAS accuracy (MMLU)",
               {**MMLU_GRID, "methods": ["kvcmas", "kvcmas-nonchained"]}, render_table8),
    PaperTable("table9", "Table 9: chained against non-chained KVCMAS TTFT",
               {**SERVING_GRID, "methods": ["kvcmas", "kvcmas-nonchained"], "target_rhos": [0.8]}, render_table9,
               protocol="paper"),
    PaperTable("fig9", "Fig 9: chained against non-chained KVCMAS, p90 TTFT (with Table 9)",
               {**SERVING_GRID, "methods": ["kvcmas", "kvcmas-nonchained"], "target_rhos": [0.8]}, render_table9,
               protocol="paper"),
    *[PaperTable(name, title, TABLE10, render_table10, protocol="paper", output_lens=(128, 512, 2048))
      for name, title in (("table10", "Table 10: TTFT with long agent outputs"),
                          ("fig10", "Fig 10: p50 TTFT with long agent outputs (with Table 10)"),
                          ("fig11", "Fig 11: p90 TTFT with long agent outputs (with Table 10)"))],
    *[PaperTable(name, title, SINGLE_GRID, render_single_stream, protocol="paper-decode")
      for name, title in (("table11", "Table 11: peak memory, single stream"),
                          ("table12", "Table 12: single-stream reuse TTFT and throughput"),
                          ("fig12", "Fig 12: single-stream TTFT, throughput and memory (Tables 11-12)"))],
    PaperTable("table13", "Table 13: anchor-pool capacity V",
               {**SINGLE_32K, "methods": ["kvcmas"], "method_params": {"kvcmas": {"V": [1, 5, 10, 20]}},
                "target_rhos": [0.8]}, render_table13,
               accuracy_grid={**MMLU_GRID, "methods": ["kvcmas"], "method_params": {"kvcmas": {"V": [1, 5, 10, 20]}}},
               protocol="paper-decode"),
    PaperTable("fig13", "Fig 13: KVCMAS's ranks r_C and r_Delta",
               {**SINGLE_32K, "methods": ["kvcmas"], "method_params": RANKS, "target_rhos": [0.8]}, render_fig13,
               accuracy_grid={**MMLU_GRID, "methods": ["kvcmas"], "method_params": RANKS}, protocol="paper-decode"),
    PaperTable("table14", "Table 14: scaling with the number of agents",
               {**SINGLE_32K, "agents": [2, 4, 8]}, render_table14, protocol="paper-decode"),
    PaperTable("table15", "Table 15: scaling with the number of rounds",
               {**SINGLE_32K, "rounds": [2, 4, 8]}, render_table15, protocol="paper-decode"),
    *[PaperTable(name, title, FIDELITY_GRID, render_measured=renderer) for name, title, renderer in (
        ("fig2", "Fig 2: effective rank of base caches and cross-agent corrections", fidelity.render_fig2),
        ("fig3", "Fig 3: KV error of chained and non-chained correction, by layer and by agent", fidelity.render_fig3),
        ("table2", "Table 2: reconstruction coverage of selective recomputation", _render_table2),
        ("fig7", "Fig 7: effective rank of PF-induced and PH-induced corrections", fidelity.render_fig7))],
]}
FIDELITY_TABLES = [name for name, table in TABLES.items() if table.render_measured is not None]
# What kvbench does not reproduce, and why (docs/paper.md says more).
NOT_COVERED = {
    "table1b": "Table 1(b), the MathVista and Video-MME columns: vision-language workloads (LLaVA-OneVision's image "
               "and video tokens); kvbench replays text prompts only",
    "fig1": "Fig 1: a diagram, no numbers",
    "table3": "Table 3: the accuracy workloads' settings, not results (its sample counts and tau are the runbook's, "
              "docs/gpu-table1.md)",
}


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
