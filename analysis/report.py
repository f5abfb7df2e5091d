"""`kvbench report`: markdown and CSV tables plus PNG plots for a set of runs."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvbench.analysis import metric_catalog, plots
from kvbench.analysis.markdown_table import NOT_MEASURED, markdown_table, md_text
from kvbench.analysis.metric_catalog import View
from kvbench.analysis.reuse_cost import reuse_turn_costs
from kvbench.analysis.runs import Run, summary_number
from kvbench.analysis.savings import reuse_turn_savings
from kvbench.analysis.shared_tier import shared_tier_table
from kvbench.analysis.tables import method_table, ttft_by_agent
from kvbench.analysis.verdict import load_line, provenance_line, verdict_lines
from kvbench.model.packaged import packaged_note
from kvbench.model.store import is_constructed

# The views whose metrics the report's tables show: their legend comes from the catalog.
REPORT_VIEWS: tuple[View, ...] = ("latency", "quality", "throughput", "goodput", "memory")


def _view(table: pd.DataFrame, view: View, leading: list[str]) -> pd.DataFrame:
    """The report table of one view: the leading columns, then the catalog's metrics of that view."""
    return table[leading + metric_catalog.columns(view, [c for c in table.columns if c not in leading])]


def write_report(runs: list[Run], out_dir: Path, title: str = "kvbench report") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = method_table(runs)
    by_agent = ttft_by_agent(runs)
    table.to_csv(out_dir / "methods.csv", index=False)
    by_agent.to_csv(out_dir / "ttft_by_agent.csv")
    figures = {
        "TTFT percentiles": plots.ttft_percentiles(table, out_dir / "ttft_percentiles.png"),
        "TTFT distribution": plots.ttft_cdf(runs, out_dir / "ttft_cdf.png"),
        "TTFT by agent position": plots.ttft_by_agent_plot(by_agent, out_dir / "ttft_by_agent.png", table),
        "Memory": plots.memory_plot(table, out_dir / "memory.png"),
    }
    tradeoff = plots.speed_quality_plot(table, out_dir / "speed_quality.png")
    if tradeoff is not None:
        figures["Speed against quality"] = tradeoff
    # Every latency row beside what it cost: its reuse and its quality against a reference.
    latency = _view(table, "latency", ["run", "method", "qps", "shared_tokens"])
    quality = _view(table, "quality", ["run"])
    idle = [md_text(r) for r in table.loc[(table["method"] != "nonshared") & ~(table["realized_rho"] > 0), "run"]]
    cold = [md_text(run.cell) for run in runs if summary_number(run.summary.get("cold_start_dense_share")) >= 0.25]
    saturated = [md_text(run.cell) for run in runs if run.saturated]
    loaded = [f"{md_text(run.cell)} ({run.others_cpu_share or 0:.0%})" for run in runs if run.machine_loaded]
    compared = bool(table[["exact_match_rate", "output_pgr", "pgr", "task_accuracy"]].notna().any().any())
    throughput = _view(table, "throughput", ["run"])
    slos = sorted({json.dumps(run.summary.get("goodput_slo")) for run in runs if run.summary.get("goodput_slo")})
    goodput = _view(table, "goodput", ["run"])
    memory = _view(table, "memory", ["run"])
    tier = shared_tier_table(runs)
    models = sorted({run.model_name for run in runs})
    savings = reuse_turn_savings(runs)
    savings.to_csv(out_dir / "reuse_turn_savings.csv", index=False)
    costs = reuse_turn_costs(runs)
    costs.to_csv(out_dir / "reuse_turn_costs.csv", index=False)
    verdict = verdict_lines(runs, savings, costs)
    # Every string a user chose (title, labels, folder and model names) goes in as text (md_text):
    # never as Markdown a reader's browser would fetch or render.
    lines = [f"# {md_text(title)}", "",
             "Model: " + ", ".join(md_text(m) + (" (a constructed test model, docs/models.md)" if is_constructed(m) else
                                               f" ({note})" if (note := packaged_note(m)) else "") for m in models), "",
             provenance_line(runs), "",
             *(["## Verdict", "", "Each method against NonShared on the same trajectories (95% intervals over "
                "trajectories; the tables below hold the detail):", "", *verdict, "", load_line(runs), ""]
               if verdict else []),
             "Runs: " + ", ".join(md_text(run.path) for run in runs), "",
             "## Latency (failures beside every figure)", "", markdown_table(latency), "",
             *([f"**Reused nothing** (realized rho 0 or unknown): {', '.join(idle)}.", ""] if idle else []),
             *([f"**Cold start**: in {', '.join(cold)}, over a quarter of the method's segment decisions went dense "
                "because its anchor pools were still empty; their reuse and TTFT are cold-start figures "
                "(`--num-warmups N --prime-method-state` measures the steady state).", ""] if cold else []),
             *([f"**Loaded machine**: while {', '.join(loaded)} ran, other processes used that share of the "
                "machine's cores (over a tenth): those runs' timings measured them too (`others_cpu_share`; "
                "compare methods within one interleaved run, or rerun on a quiet machine).", ""] if loaded else []),
             *([f"**Saturated** (marked `[saturated]`): {', '.join(saturated)} stopped early, their backlog and TTFT "
                "growing without bound: their figures describe a growing queue at that QPS, not a steady state "
                "(this machine cannot serve it).", ""] if saturated else []),
             *(["## What reuse saves: reuse turns against NonShared's (p50 TTFT ratio, 95% interval over "
                "trajectories)", "",
                "Reuse turns: turns some earlier agent's cache could serve; first turns reuse nothing (there a "
                "method should cost nothing). Each run is compared with the NonShared run of its own comparison "
                "(`replay --method a,b,c`, the quickstart), never another invocation's. The noise floor is the A/A "
                "arm's ratio (NonShared replayed again, taken in turn like the methods): a ratio whose interval "
                "holds 1 or meets the noise floor's is no finding (`within noise`). `reuse_repeats`: where a cell ran "
                "several times (`sweep --repeats`), the lowest and highest of its repeats' ratios: the spread between "
                "runs, beside each run's interval within itself.", "",
                markdown_table(savings), ""] if len(savings) else []),
             *(["## What reuse costs: reuse turns against the reference (mean, 95% interval over trajectories)", "",
                "Task accuracy where the answer is known; exact match, token F1 and first-token KL against the "
                "reference's output of the same turn; where the differing outputs first diverge (token index). "
                "NonShared's own row is the noise floor: a gap inside its interval is no finding.", "",
                markdown_table(costs, ".1f"), ""] if len(costs) else []),
             "## Quality (against a NonShared reference: `replay --reference`, `kvbench quality`)", "",
             markdown_table(quality, ".3f") if compared else
             "No run here was compared with a reference or scored on a task: the tables above say what the "
             "methods save, not what they cost in outputs.", "",
             "## Workflows, throughput and reuse", "", markdown_table(throughput, ".3f"), "",
             *(["## Goodput (per second; shares of all requests and workflows)", "",
                "Bounds (ms): " + "; ".join(slos) + (" (runs differ: compare with care)" if len(slos) > 1 else ""),
                "", markdown_table(goodput, ".3f"), ""] if slos else []),
             "## Memory", "", markdown_table(memory), "",
             *(["## Shared tier (Mooncake Store between instances; lookups by source key)", "",
                "A remote hit is a source read from another instance's save; a miss was computed densely (a rejected "
                "entry, corrupt or another model's, counts as one).", "", markdown_table(tier, ".2f"), ""] if len(tier) else []),
             "## p50 TTFT (ms) by agent position", "", markdown_table(by_agent.reset_index()), "",
             "## Columns", "", f"`{NOT_MEASURED}`: not measured for that run (no reference to compare with, no task "
             "to score, no connector to report reuse, no server memory read).", "",
             *[f"- `{name}`: {note}" for name, note in metric_catalog.notes(REPORT_VIEWS)], "",
             "## Figures", ""]
    lines += [f"![{caption}]({path.name})" for caption, path in figures.items()]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report
