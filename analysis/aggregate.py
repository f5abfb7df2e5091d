"""One row per run of a sweep (its grid coordinates and headline metrics), and repeat averaging."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from kvbench.analysis import metric_catalog
from kvbench.analysis.runs import Run, summary_number

DIMENSIONS = ["method_config", "method", "method_params", "model", "task", "shared_tokens", "agents", "rounds",
              "output_len", "protocol", "qps"]
# Each run's row: the catalog's sweep metrics (what a method saves and what it costs; the
# quality keys NaN for runs never compared with a reference or scored on a task).
METRICS = metric_catalog.keys("sweep")
# Those read from the summary as they are (the rest computed below, or memory's from the report table)
SUMMARY_METRICS = metric_catalog.keys("sweep", record="summary")


def run_row(run: Run) -> dict:
    generator = run.config.get("trace_header", {}).get("generator", {})
    requests = run.requests
    ok = requests[requests["success"]]
    reuse = ok[ok["reusable_tokens"] > 0]
    memory = run.memory()
    # a trajectory's length: its longest request, prompt and output (the paper's Table 4)
    lengths = ((ok["prompt_tokens"] + ok["output_tokens"]).groupby(ok["trajectory_id"]).max()
               if len(ok) and {"prompt_tokens", "output_tokens"} <= set(ok.columns) else None)
    return {
        "method_config": run.config.get("method_config") or run.name,
        "method": run.method,
        # the configuration's parameters as sorted JSON (a grouping key; `method_params` reads it back)
        "method_params": json.dumps(run.config.get("method_params") or {}, sort_keys=True),
        "model": run.model_name,
        # "none" for controlled workloads (a grouping key: never missing)
        "task": generator.get("task") or "none",
        "shared_tokens": generator.get("shared_tokens"),
        "agents": generator.get("num_agents"),
        "rounds": generator.get("rounds"),
        "output_len": generator.get("output_len"),
        "protocol": run.config.get("protocol", "free"),
        "qps": run.summary.get("request_rate"),
        "repeat": int(run.summary.get("repeat", 0)),
        **{key: summary_number(run.summary.get(key)) for key in SUMMARY_METRICS},
        "p50_ttft_s": summary_number(run.summary.get("p50_ttft_ms")) / 1e3,
        "p90_ttft_s": summary_number(run.summary.get("p90_ttft_ms")) / 1e3,
        "mean_ttft_s": float(ok["ttft_ms"].mean()) / 1e3 if len(ok) else math.nan,
        # the mean of each trajectory's mean TTFT (the paper's Table 1 TTFT)
        "mean_trajectory_ttft_s": summary_number(run.summary.get("mean_trajectory_ttft_ms")) / 1e3,
        "mean_trajectory_tokens": float(lengths.mean()) if lengths is not None else math.nan,
        "max_trajectory_tokens": float(lengths.max()) if lengths is not None else math.nan,
        "reuse_ttft_s": float(reuse["ttft_ms"].mean()) / 1e3 if len(reuse) else math.nan,
        "latency_s": summary_number(run.summary.get("mean_trajectory_e2e_ms")) / 1e3,
        "throughput_tok_s": summary_number(run.summary.get("mean_trajectory_token_throughput")),
        "method_state_mib": memory["method_state_mib"],
        "peak_server_rss_mib": memory["peak_server_rss_mib"],
        "peak_kv_usage_pct": 100 * memory["peak_kv_cache_usage_perc"],
        "task_items": summary_number(run.summary.get("task_scored_trajectories")),
        "saturated": float(run.saturated),  # averaged over repeats: the share that stopped over-saturated
    }


def runs_frame(runs: list[Run]) -> pd.DataFrame:
    return pd.DataFrame([run_row(run) for run in runs])


def average_repeats(frame: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Mean over repeats per grid point, with `<metric>_ci`: the half-width of the Student-t
    confidence interval (NaN with a single repeat)."""
    grouped = frame.groupby(DIMENSIONS, dropna=False)
    out = grouped[METRICS].mean()
    counts = grouped.size()
    for metric in METRICS:
        sem = grouped[metric].sem()
        t = counts.map(lambda n: stats.t.ppf(0.5 + confidence / 2, n - 1) if n > 1 else np.nan)
        out[f"{metric}_ci"] = sem * t
    out["repeats"] = counts
    out["task_accuracy_std"] = grouped["task_accuracy"].std()  # run-to-run spread (the paper's Table 5)
    return out.reset_index()


def method_params(row: pd.Series) -> dict[str, Any]:
    """A frame row's method parameters (tau, V, ...)."""
    return dict(json.loads(row["method_params"]))
