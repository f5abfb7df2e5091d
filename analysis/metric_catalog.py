"""Every metric kvbench reports, defined once: its key, unit, meaning, which way is better, where
it is measured, and the tables, console lines and gates that show it.

The report's tables and legend, the console summary, the sweep's aggregates, the leaderboard's
legend, `kvbench compare` (directions, default metrics, which gates a loaded machine voids) and
docs/results.md's metric table all read this list; a new metric is one entry here (and the code
that computes it). `python -m kvbench.analysis.metric_catalog --write docs/results.md` renders the
docs table; a test checks that the docs hold that rendering and that every key is produced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

Unit = Literal["ms", "s", "req/s", "tok/s", "workflows/s", "share", "count", "tokens", "MiB", "GiB", "bytes", "nats",
               "%"]
# client: the replayer's own clock and records; server: vLLM's /metrics and process memory;
# connector: kvbench's worker-side stats; reference: outputs against a NonShared reference run;
# task: answers against a task's gold answers; machine: what else the machine ran meanwhile.
Source = Literal["client", "server", "connector", "reference", "task", "machine"]
# Where a key is written: summary.json (a run's summary), a column of the report's per-run table
# (derived from the summary: `kvbench report`'s methods.csv), or a sweep's per-run aggregate row.
Record = Literal["summary", "report", "sweep"]
# What shows it: the console summary, the report's tables, `kvbench compare`'s default metrics,
# the leaderboard, a sweep's rows (averaged over repeats, the paper's tables read them).
View = Literal["console", "latency", "quality", "throughput", "goodput", "memory", "compare", "leaderboard", "sweep"]
Better = Literal["higher", "lower"]

STATS_PATTERN = r"(?:mean|median|std|p\d+(?:\.\d+)?)"  # vLLM's: mean, median, std, p50, p99.9
TIME_UNITS = frozenset({"ms", "s", "req/s", "tok/s", "workflows/s"})


@dataclass(frozen=True)
class Metric:
    key: str  # a family's key holds `{stat}`: mean_ttft_ms, p99_ttft_ms, ...
    unit: Unit
    description: str
    source: Source
    better: Better | None = None  # None: neither (a count of what ran, a duration)
    record: Record = "summary"
    views: frozenset[View] = frozenset()
    label: str = ""  # the console's words for it (console metrics only)
    compared_stats: tuple[str, ...] = ()  # a family's stats `kvbench compare` shows by default
    timing: bool | None = None  # a figure the machine's speed moves (default: by its unit)

    @property
    def share(self) -> bool:
        """A share or score in 0..1: three decimals in every table."""
        return self.unit == "share"

    @property
    def family(self) -> bool:
        return "{stat}" in self.key

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.key).replace(re.escape("{stat}"), STATS_PATTERN))

    @property
    def speed_dependent(self) -> bool:
        """Whether a loaded machine moves it (compare does not gate on such figures silently)."""
        return self.timing if self.timing is not None else self.unit in TIME_UNITS

    def matches(self, key: str) -> bool:
        return self.pattern.fullmatch(key) is not None

    def keys(self, stats: tuple[str, ...]) -> list[str]:
        return [self.key.replace("{stat}", stat) for stat in stats] if self.family else [self.key]


def _m(key: str, unit: Unit, source: Source, better: Better | None, views: str, description: str,
       **extra: object) -> Metric:
    """One entry, its views as a space-separated string (the table below stays one line a metric)."""
    return Metric(key, unit, description, source, better, views=frozenset(views.split()),  # type: ignore[arg-type]
                  **extra)  # type: ignore[arg-type]


CATALOG: tuple[Metric, ...] = (
    # -- what a run served, and how fast (client) --
    _m("completed", "count", "client", "higher", "console latency throughput", "requests that succeeded",
       label="Completed requests"),
    _m("failed", "count", "client", "lower", "console latency throughput compare leaderboard sweep",
       "requests that failed (recorded with their error, never dropped)", label="Failed requests"),
    _m("completed_trajectories", "count", "client", "higher", "console",
       "workflows (trajectories) all of whose turns succeeded", label="Completed trajectories"),
    _m("failed_trajectories", "count", "client", "lower", "console latency",
       "workflows with a failed turn", label="Failed trajectories"),
    _m("duration", "s", "client", None, "console",
       "serving seconds the rates are over (a resumed run's active time; an interleaved run's own turns)",
       label="Duration (s)"),
    _m("request_throughput", "req/s", "client", "higher", "console", "requests completed per second",
       label="Request throughput (req/s)"),
    _m("output_throughput", "tok/s", "client", "higher", "console", "output tokens per second",
       label="Output token throughput (tok/s)"),
    _m("total_token_throughput", "tok/s", "client", "higher", "", "prompt and output tokens per second"),
    _m("{stat}_ttft_ms", "ms", "client", "lower", "console latency compare",
       "time to first token per request, over successful requests (vLLM's definition)", compared_stats=("p50", "p90")),
    _m("{stat}_tpot_ms", "ms", "client", "lower", "console", "time per output token after the first, per request"),
    _m("{stat}_itl_ms", "ms", "client", "lower", "console", "inter-token latency, every gap pooled (vLLM's)"),
    _m("{stat}_trajectory_ttft_ms", "ms", "client", "lower", "console latency compare",
       "the per-trajectory mean TTFT, summarized over trajectories (the paper's definition)",
       compared_stats=("p50",)),
    _m("{stat}_e2el_ms", "ms", "client", "lower", "console latency compare", "a request's end-to-end latency",
       compared_stats=("mean",)),
    _m("mean_trajectory_e2e_ms", "ms", "client", "lower", "", "a trajectory's first arrival to its last token, mean"),
    _m("{stat}_workflow_ms", "ms", "client", "lower", "console throughput",
       "a workflow's makespan: its trajectory's first arrival to its last agent's last token"),
    _m("workflow_throughput", "workflows/s", "client", "higher", "throughput", "workflows finished per second"),
    _m("mean_trajectory_token_throughput", "tok/s", "client", "higher", "throughput compare",
       "trajectory tokens (prompt + output) / trajectory end-to-end time, mean over trajectories"),
    _m("request_goodput", "req/s", "client", "higher", "console goodput",
       "requests per second that succeeded and met every `--goodput` bound (None without bounds)",
       label="Request goodput (req/s)"),
    _m("request_goodput_share", "share", "client", "higher", "console goodput",
       "of all requests, those meeting every `--goodput` bound", timing=True,
       label="Request goodput (share of requests)"),
    _m("workflow_goodput", "workflows/s", "client", "higher", "console goodput",
       "workflows per second all of whose turns met the request bounds and whose makespan met `workflow`",
       label="Workflow goodput (workflows/s)"),
    _m("workflow_goodput_share", "share", "client", "higher", "console goodput leaderboard",
       "of all workflows, those meeting every `--goodput` bound", timing=True,
       label="Workflow goodput (share of workflows)"),
    _m("warmup_per_trajectory_s", "s", "client", "lower", "",
       "the warm-ups' wall time per warm-up trajectory (a method's anchor building included)"),
    # -- what reuse served (connector; vLLM's own prefix cache from the server) --
    _m("prefix_cache_hit_share", "share", "server", None, "console throughput",
       "vLLM's prefix-cache hits / queries over the run (tokens; its /metrics, every server)",
       label="vLLM prefix-cache hits (tokens)"),
    _m("reuse_share", "share", "connector", "higher", "console throughput",
       "rows the method served from another request's cache / shared (PH) tokens of successful requests",
       label="Reuse share (reused / shared tokens)"),
    _m("realized_rho", "share", "connector", "higher", "console latency quality throughput compare leaderboard sweep",
       "shared PH tokens served by reuse / PH tokens the method could have served had the store kept every source",
       label="Realized rho (reused / eligible shared tokens)"),
    _m("eligible_rho", "share", "connector", "higher", "throughput",
       "shared PH tokens served by reuse / PH tokens whose source the store still held"),
    _m("reuse_lost_to_eviction_share", "share", "connector", "lower", "throughput",
       "reusable PH tokens whose source the store's byte cap had evicted"),
    _m("reuse_lost_to_refusal_share", "share", "connector", "lower", "throughput",
       "reusable PH tokens whose source was larger than the store's whole cap (never stored: raise "
       "--max-store-bytes)"),
    _m("recompute_share", "share", "connector", "lower", "leaderboard",
       "shared (token, layer) entries computed / all the method could have reused (1 - rho for plain reuse)"),
    _m("cold_start_dense_share", "share", "connector", "lower", "",
       "segment decisions sent dense only because the anchor pools held fewer than two anchors (a cold start)"),
    _m("cold_start_trajectories", "trajectories", "connector", "lower", "",
       "measured trajectories (in arrival order) up to the last one with such a decision: the warm-ups the "
       "run lacked"),
    # -- memory --
    _m("method_state_mib", "MiB", "connector", "lower", "memory leaderboard sweep",
       "method state: segment-store peak + the method's own state (anchor pools, references)", record="report"),
    _m("store_peak_mib", "MiB", "connector", "lower", "memory", "segment-store peak of this run (since its reset)",
       record="report"),
    _m("method_store_peak_bytes", "bytes", "connector", "lower", "",
       "the segment store's peak (each segment resets it: the largest of any segment)"),
    _m("store_evictions", "count", "connector", "lower", "memory",
       "segment-store evictions during this run (its byte cap, --max-store-bytes)"),
    _m("store_refused", "count", "connector", "lower", "memory",
       "caches larger than the store's whole cap, never stored (not evictions)"),
    _m("peak_server_rss_bytes", "bytes", "server", "lower", "console",
       "peak RSS of the server process tree, every server's largest (CPU); vLLM pre-allocates its KV pool",
       label="Peak server RSS"),
    _m("peak_server_rss_mib", "MiB", "server", "lower", "memory sweep", "peak_server_rss_bytes in MiB",
       record="report"),
    _m("peak_kv_cache_usage_perc", "share", "server", "lower", "console memory",
       "peak of vLLM's vllm:kv_cache_usage_perc gauge during the run (0..1, as vLLM reports it)",
       label="Peak KV cache usage"),
    _m("peak_gpu_memory_gib", "GiB", "server", "lower", "sweep",
       "peak of torch's allocated bytes in the server's workers (the paper's measure; null on a CPU)"),
    _m("peak_cpu_tensor_memory_gib", "GiB", "server", "lower", "sweep",
       "its CPU twin: model weights + KV pool + store and method-state peaks (null on a GPU)"),
    # -- what reuse cost: outputs against the reference, answers against the task --
    _m("exact_match_rate", "share", "reference", "higher", "latency quality compare leaderboard sweep",
       "compared turns whose output token ids equal the reference's"),
    _m("exact_match_rate_reuse", "share", "reference", "higher", "quality",
       "the same over reuse turns (turns reading an earlier turn's shared segment)"),
    _m("mean_token_f1", "share", "reference", "higher", "quality compare sweep",
       "F1 of the output's and the reference's bags of token ids, mean over compared turns"),
    _m("mean_first_token_kl", "nats", "reference", "lower", "quality",
       "KL(reference || method) of the first-token distributions (runs with --logprobs)"),
    _m("top1_agreement", "share", "reference", "higher", "quality", "turns whose first generated tokens agree"),
    _m("mean_first_divergence", "tokens", "reference", "higher", "",
       "index of the first token differing from the reference's, mean over compared turns"),
    _m("output_pgr", "share", "reference", "higher", "latency quality compare leaderboard sweep",
       "PGR over the outputs: (F1 - floor F1) / (1 - floor F1) against the reference"),
    _m("output_pgr_low", "share", "reference", "higher", "quality leaderboard", "output_pgr's 95% interval, low end"),
    _m("output_pgr_high", "share", "reference", "higher", "quality leaderboard", "output_pgr's 95% interval, high end"),
    _m("pgr", "share", "task", "higher", "latency quality compare leaderboard sweep",
       "KVShareArena's PGR over a task trace's score (the reference's accuracy is the oracle's)"),
    _m("pgr_low", "share", "task", "higher", "quality leaderboard", "pgr's 95% interval, low end"),
    _m("pgr_high", "share", "task", "higher", "quality leaderboard", "pgr's 95% interval, high end"),
    _m("task_accuracy", "share", "task", "higher", "console latency quality compare leaderboard sweep",
       "a task trace's final answers right (`kvbench score`; HumanEval: pass@1)", label="Task accuracy"),
    _m("task_accuracy_reuse", "share", "task", "higher", "console latency quality leaderboard",
       "the same over reuse turns (turns a method can serve from another agent's cache)",
       label="Task accuracy, reuse turns"),
    _m("task_unparseable", "count", "task", "lower", "quality sweep",
       "benchmark tasks' final answers that could not be read (no MMLU answer line, no GSM8K number)"),
    # -- the machine meanwhile --
    _m("others_cpu_share", "share", "machine", "lower", "console",
       "share of all cores processes outside kvbench and its servers used while the run ran (mean)",
       label="Other processes' CPU (share of the cores)"),
    _m("p90_others_cpu_share", "share", "machine", "lower", "", "the same at its 90th percentile over the samples"),
    _m("steal_cpu_share", "share", "machine", "lower", "", "share of the cores the hypervisor stole"),
    _m("min_available_memory_bytes", "bytes", "machine", "higher", "", "the least memory available during the run"),
    _m("max_memory_pressure", "share", "machine", "lower", "",
       "the highest memory pressure (Linux PSI: share of 10 s some task stalled)"),
    # -- a sweep's per-run rows (kvbench.analysis.aggregate: the paper's units, seconds) --
    *(_m(key, unit, source, better, "sweep", description, record="sweep") for key, unit, source, better, description in (
        ("p50_ttft_s", "s", "client", "lower", "p50_ttft_ms in seconds"),
        ("p90_ttft_s", "s", "client", "lower", "p90_ttft_ms in seconds"),
        ("mean_ttft_s", "s", "client", "lower", "mean TTFT over successful requests, seconds"),
        ("mean_trajectory_ttft_s", "s", "client", "lower", "mean_trajectory_ttft_ms in seconds (the paper's TTFT)"),
        ("reuse_ttft_s", "s", "client", "lower", "mean TTFT of reuse turns (reusable_tokens > 0), seconds"),
        ("latency_s", "s", "client", "lower", "mean_trajectory_e2e_ms in seconds (the paper's latency)"),
        ("throughput_tok_s", "tok/s", "client", "higher", "mean_trajectory_token_throughput"),
        ("mean_trajectory_tokens", "tokens", "client", None, "a trajectory's longest request (prompt + output), mean"),
        ("max_trajectory_tokens", "tokens", "client", None, "the same, largest"),
        ("peak_kv_usage_pct", "%", "server", "lower", "peak_kv_cache_usage_perc in percent"),
        ("task_items", "count", "task", None, "trajectories scored (task_scored_trajectories)"),
        ("saturated", "share", "client", "lower", "1 when the run stopped over-saturated (averaged: the share)"),
    )),
)


class UnknownMetric(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


SPLITS = {"_reuse": "reuse turns", "_first": "first turns"}  # a quality or task figure over part of the turns


def lookup(key: str) -> Metric:
    """The catalog's entry for a key (a family's member too: p99_ttft_ms; a quality or task
    figure over reuse or first turns: task_accuracy_first); UnknownMetric naming the catalog
    otherwise."""
    for metric in CATALOG:
        if metric.key == key or (metric.family and metric.matches(key)):
            return metric
    for suffix, turns in SPLITS.items():
        base = find(key.removesuffix(suffix)) if key.endswith(suffix) else None
        if base is not None and base.source in ("reference", "task"):
            return replace(base, key=key, description=f"{base.key} over {turns}", views=frozenset(), label="")
    import difflib

    known = [member for metric in CATALOG for member in metric.keys(("mean", "median", "p50", "p90", "p99"))]
    close = difflib.get_close_matches(key, known, n=3)
    raise UnknownMetric(f"unknown metric {key!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                        + ": docs/results.md#metrics lists them")


def find(key: str) -> Metric | None:
    try:
        return lookup(key)
    except UnknownMetric:
        return None


def in_view(view: View) -> list[Metric]:
    return [metric for metric in CATALOG if view in metric.views]


def columns(view: View, available: list[str]) -> list[str]:
    """The columns of `available` a table shows, in the catalog's order (a family: each of its
    members there, in their order)."""
    return [column for metric in in_view(view) for column in available
            if (metric.matches(column) if metric.family else column == metric.key)]


def keys(view: View, record: Record | None = None) -> list[str]:
    """The plain keys a view shows (families left out), optionally of one record."""
    return [m.key for m in in_view(view) if not m.family and (record is None or m.record == record)]


def compared_keys() -> list[str]:
    """`kvbench compare`'s default metrics: both axes, what a method saves and what it costs."""
    return [key for metric in in_view("compare") for key in metric.keys(metric.compared_stats)]


def format_value(metric: Metric, value: float) -> str:
    """A value as the console shows it: shares three decimals (as every table), bytes in MiB."""
    if metric.unit == "bytes":
        return f"{value / 2**20:,.0f} MiB"
    if metric.share:
        return f"{value:.3f}"
    if metric.unit == "count":
        return f"{value:.0f}"
    return f"{value:.3f}" if metric.unit in ("workflows/s", "nats") else f"{value:.2f}"


def console_rows(summary: dict[str, object], stats: list[str]) -> list[tuple[str, str]]:
    """(label, value) of each console metric a summary holds (None: left out), in the catalog's
    order; a family's members for `stats`, named by their keys."""
    rows = []
    for metric in in_view("console"):
        for key in metric.keys(tuple(stats)):
            value = summary.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                rows.append((metric.label or key, format_value(metric, float(value))))
    return rows


def is_share(column: str) -> bool:
    metric = find(column)
    return metric is not None and metric.share


def notes(views: tuple[View, ...]) -> list[tuple[str, str]]:
    """(key, unit and description) of each metric the given views show: a report's legend."""
    return [(m.key.replace("{stat}", "pNN"), f"{m.description} ({m.unit})")
            for m in CATALOG if m.views & set(views)]


def render_markdown() -> str:
    """The docs table: one row per metric."""
    lines = ["| key | unit | better | source | shown in | meaning |", "|---|---|---|---|---|---|"]
    for m in CATALOG:
        key = m.key.replace("{stat}", "{mean,median,std,p50,p90,p99}")
        shown = ", ".join(sorted(m.views)) or "-"
        where = "" if m.record == "summary" else f" ({'report table' if m.record == 'report' else 'sweep row'})"
        lines.append(f"| `{key}`{where} | {m.unit} | {m.better or '-'} | {m.source} | {shown} | "
                     f"{m.description.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)


BEGIN, END = "<!-- metric catalog: begin -->", "<!-- metric catalog: end -->"


def docs_block(text: str) -> str:
    """What a docs file holds between the markers (ValueError without them)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[start + len(BEGIN):end].strip("\n")


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace the catalog block of this markdown file")
    args = parser.parse_args(argv)
    table = render_markdown()
    if args.write is None:
        print(table)
        return 0
    text = args.write.read_text()
    docs_block(text)  # the markers must be there
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    args.write.write_text(f"{text[:start]}\n{table}\n{text[end:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
