"""`kvbench report`: markdown and CSV tables plus PNG plots for a set of runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from kvbench.analysis import plots
from kvbench.analysis.reuse_cost import reuse_turn_costs
from kvbench.analysis.runs import Run, summary_number
from kvbench.analysis.savings import reuse_turn_savings
from kvbench.analysis.shared_tier import shared_tier_table
from kvbench.analysis.tables import method_table, ttft_by_agent
from kvbench.analysis.verdict import load_line, provenance_line, verdict_lines
from kvbench.model.packaged import packaged_note
from kvbench.model.store import is_constructed

COLUMN_NOTES = {
    "pNN_ttft_ms": "request-level TTFT percentiles over successful requests (vLLM's definition)",
    "pNN_trajectory_ttft_ms": "percentiles of the per-trajectory mean TTFT (the paper's definition)",
    "trajectory_token_throughput": "trajectory tokens (prompt + output) / trajectory E2E, mean over trajectories",
    "pNN_workflow_ms": "a workflow's makespan: its trajectory's first arrival to its last agent's last token",
    "workflow_throughput": "workflows (trajectories) finished per second of the run",
    "request_goodput / workflow_goodput": "requests / workflows per second meeting every `--goodput` bound (a "
                                          "workflow: all its turns, and its makespan the `workflow` bound)",
    "prefix_cache_hit_share": "vLLM's prefix-cache hits / queries over the run (tokens; its /metrics, every server)",
    "reuse_share": "rows the method served from another request's cache / shared (PH) tokens of successful requests",
    "realized_rho": "shared PH tokens served by reuse / PH tokens the method could have served had the "
                    "segment store kept every source",
    "eligible_rho": "shared PH tokens served by reuse / PH tokens whose source the store still held",
    "reuse_lost_to_eviction_share": "reusable PH tokens whose source the store's byte cap had evicted",
    "reuse_lost_to_refusal_share": "reusable PH tokens whose source was larger than the store's whole cap "
                                   "(never stored: raise --max-store-bytes)",
    "method_state_mib": "method state: segment-store peak + method state (anchor pools, references)",
    "store_peak_mib": "segment-store peak of this run (since its reset)",
    "store_evictions": "segment-store evictions during this run (its byte cap, --max-store-bytes)",
    "store_refused": "caches larger than the store's whole cap, never stored (not evictions)",
    "peak_server_rss_mib": "peak RSS of the server process tree (CPU); vLLM pre-allocates its KV pool",
    "peak_kv_cache_usage_perc": "peak of vllm:kv_cache_usage_perc during the run",
    "task_accuracy": "a task trace's final answers right (`kvbench score`)",
    "task_unparseable": "a benchmark workload's final answers that could not be read (no MMLU answer line, no "
                        "GSM8K number)",
    "task_accuracy_reuse": "a task trace's answers right on reuse turns (turns a method can serve from another "
                           "agent's cache)",
}


# Shares and scores (0..1) keep three decimals in every table, so one figure reads the same in
# each (realized rho was 0.8 in the latency table and 0.839 in the quality table).
SHARE_COLUMNS = re.compile(r"rho|_rate|_share|pgr|accuracy|token_f1|top1_agreement|first_token_kl")


NOT_MEASURED = "-"  # a figure this run has not (no reference, no task, no connector): said in the legend


def _markdown(frame: pd.DataFrame, floatfmt: str = ".1f") -> str:
    """The table with each number in its column's format and every missing figure a dash, not `nan`."""
    shown = pd.DataFrame(index=frame.index)
    for column in frame.columns:
        fmt = ".3f" if SHARE_COLUMNS.search(column) else floatfmt
        shown[column] = [NOT_MEASURED if _missing(v) else format(v, fmt) if isinstance(v, float) else str(v)
                         for v in frame[column]]
    align = ["right" if pd.api.types.is_numeric_dtype(frame[c]) else "left" for c in frame.columns]
    return shown.to_markdown(index=False, disable_numparse=True, colalign=align)


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and value != value)  # NaN


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
    latency = table[["run", "method", "qps", "shared_tokens", "completed", "failed", "failed_trajectories",
                     *[c for c in table if c.endswith("_ttft_ms")], "mean_e2el_ms", "realized_rho", "exact_match_rate",
                     "output_pgr", "pgr", "task_accuracy", "task_accuracy_reuse"]]
    quality = table[["run", "realized_rho", "exact_match_rate", "exact_match_rate_reuse", "mean_token_f1",
                     "mean_first_token_kl", "top1_agreement", "output_pgr", "output_pgr_low", "output_pgr_high",
                     "pgr", "pgr_low", "pgr_high", "task_accuracy",
                     "task_accuracy_reuse", "task_unparseable"]]
    idle = table[(table["method"] != "nonshared") & ~(table["realized_rho"] > 0)]
    cold = [run.cell for run in runs if summary_number(run.summary.get("cold_start_dense_share")) >= 0.25]
    saturated = [run.cell for run in runs if run.saturated]
    loaded = [f"{run.cell} ({run.others_cpu_share or 0:.0%})" for run in runs if run.machine_loaded]
    compared = bool(table[["exact_match_rate", "output_pgr", "pgr", "task_accuracy"]].notna().any().any())
    throughput = table[["run", "completed", "failed", *[c for c in table if c.endswith("_workflow_ms")],
                        "workflow_throughput", "trajectory_token_throughput", "prefix_cache_hit_share", "reuse_share",
                        "realized_rho", "eligible_rho",
                        "reuse_lost_to_eviction_share", "reuse_lost_to_refusal_share"]]
    slos = sorted({json.dumps(run.summary.get("goodput_slo")) for run in runs if run.summary.get("goodput_slo")})
    goodput = table[["run", "request_goodput", "request_goodput_share", "workflow_goodput", "workflow_goodput_share"]]
    memory = table[["run", "method_state_mib", "store_peak_mib", "store_evictions", "store_refused", "peak_server_rss_mib",
                    "peak_kv_cache_usage_perc"]]
    tier = shared_tier_table(runs)
    models = sorted({run.model_name for run in runs})
    savings = reuse_turn_savings(runs)
    savings.to_csv(out_dir / "reuse_turn_savings.csv", index=False)
    costs = reuse_turn_costs(runs)
    costs.to_csv(out_dir / "reuse_turn_costs.csv", index=False)
    verdict = verdict_lines(runs, savings, costs)
    lines = [f"# {title}", "",
             "Model: " + ", ".join(f"`{m}`" + (" (a constructed test model, docs/models.md)" if is_constructed(m) else
                                               f" ({note})" if (note := packaged_note(m)) else "") for m in models), "",
             provenance_line(runs), "",
             *(["## Verdict", "", "Each method against NonShared on the same trajectories (95% intervals over "
                "trajectories; the tables below hold the detail):", "", *verdict, "", load_line(runs), ""]
               if verdict else []),
             "Runs: " + ", ".join(f"`{run.path}`" for run in runs), "",
             "## Latency (failures beside every figure)", "", _markdown(latency), "",
             *([f"**Reused nothing** (realized rho 0 or unknown): {', '.join(idle['run'])}.", ""] if len(idle) else []),
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
                "holds 1 or meets the noise floor's is no finding (`within noise`).", "",
                _markdown(savings), ""] if len(savings) else []),
             *(["## What reuse costs: reuse turns against the reference (mean, 95% interval over trajectories)", "",
                "Task accuracy where the answer is known; exact match, token F1 and first-token KL against the "
                "reference's output of the same turn; where the differing outputs first diverge (token index). "
                "NonShared's own row is the noise floor: a gap inside its interval is no finding.", "",
                _markdown(costs, ".1f"), ""] if len(costs) else []),
             "## Quality (against a NonShared reference: `replay --reference`, `kvbench quality`)", "",
             _markdown(quality, ".3f") if compared else
             "No run here was compared with a reference or scored on a task: the tables above say what the "
             "methods save, not what they cost in outputs.", "",
             "## Workflows, throughput and reuse", "", _markdown(throughput, ".3f"), "",
             *(["## Goodput (per second; shares of all requests and workflows)", "",
                "Bounds (ms): " + "; ".join(slos) + (" (runs differ: compare with care)" if len(slos) > 1 else ""),
                "", _markdown(goodput, ".3f"), ""] if slos else []),
             "## Memory", "", _markdown(memory), "",
             *(["## Shared tier (Mooncake Store between instances; lookups by source key)", "",
                "A remote hit is a source read from another instance's save; a miss was computed densely (a rejected "
                "entry, corrupt or another model's, counts as one).", "", _markdown(tier, ".2f"), ""] if len(tier) else []),
             "## p50 TTFT (ms) by agent position", "", by_agent.to_markdown(floatfmt=".1f"), "",
             "## Columns", "", f"`{NOT_MEASURED}`: not measured for that run (no reference to compare with, no task "
             "to score, no connector to report reuse, no server memory read).", "",
             *[f"- `{name}`: {note}" for name, note in COLUMN_NOTES.items()], "",
             "## Figures", ""]
    lines += [f"![{caption}]({path.name})" for caption, path in figures.items()]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report
