"""A run's `summary.json`, computed from the files the replayer wrote.

The replayer records (requests, the connector's stats journal, server samples, the config with
one entry per serving segment); every aggregate comes from here, so a summary can be recomputed
from a run directory at any time (`kvbench summarize RUN_DIR`) and the replayer does not depend
on analysis.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench import run_files
from kvbench.analysis.device_memory import memory_figures, segment_device_memory
from kvbench.analysis.metrics import summarize
from kvbench.analysis.quality import read_quality_figures
from kvbench.analysis.shared_tier import shared_tier_figures
from kvbench.analysis.task_score import read_task_figures
from kvbench.replay.machine_load import load_figures

MAX_LISTED_MISSING = 50


def store_figures(result_dir: Path, segment: int, journal: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The store and method-state figures of one segment, over its servers: a server's store peak
    is its own and the run's the largest; evictions and refusals add up; each kind of method
    state has its largest value over the segment's polls. None where no server reported.
    `journal`: the run's method-stats journal, when the caller has read it already."""
    if journal is None:
        journal = run_files.read_jsonl(result_dir / run_files.METHOD_STATS)
    states = [e for e in journal if e.get("kind") == "state" and e.get("segment") == segment]
    if not states:
        return {"method_store_peak_bytes": None, "store_evictions": None, "store_refused": None,
                "method_state_bytes": None}
    latest = {state["server_url"]: state for state in states}  # the journal is in time order
    peaks: dict[str, int] = {}
    for state in states:
        for name, value in (state.get("method_state_bytes") or {}).items():
            peaks[name] = max(peaks.get(name, 0), value)
    return {
        "method_store_peak_bytes": max(s["store_peak_bytes"] for s in latest.values()),
        "store_evictions": sum(s["store_evictions"] for s in latest.values()),
        "store_refused": sum(s["store_refused"] for s in latest.values()),
        "method_state_bytes": peaks,
    }


def server_figures(result_dir: Path, segment: int, journal: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Peaks and run deltas of one segment's server samples, over all servers. `journal`: the
    run's server-metrics journal, when the caller has read it already."""
    if journal is None:
        journal = run_files.read_jsonl(result_dir / run_files.SERVER_METRICS)
    samples = [s for s in journal if s.get("segment") == segment]
    rss = [s["process_tree_rss_bytes"] for s in samples if "process_tree_rss_bytes" in s]
    usage = [s["vllm:kv_cache_usage_perc"] for s in samples if "vllm:kv_cache_usage_perc" in s]
    out: dict[str, Any] = {"peak_server_rss_bytes": max(rss) if rss else None,
                           "peak_kv_cache_usage_perc": max(usage) if usage else None,
                           "device_memory": segment_device_memory(samples)}
    servers = list(dict.fromkeys(s["server_url"] for s in samples))
    for name, key in (("vllm:prefix_cache_hits_total", "prefix_cache_hits"),
                      ("vllm:prefix_cache_queries_total", "prefix_cache_queries"),
                      ("vllm:num_preemptions_total", "num_preemptions")):
        deltas = [series[-1] - series[0] for url in servers
                  if (series := [s[name] for s in samples if s["server_url"] == url and name in s])]
        out[key] = sum(deltas) if deltas else None
    return out


def _stats_missing(result_dir: Path, requests: pd.DataFrame, recorded: list[str]) -> list[str]:
    """Successful requests of a connector run whose method stats are not in their records: those
    the run recorded as missing, and any other (a run cut short by a full disk before it copied
    the stats in, or wrote down which were missing). Never under-counted: reuse figures leave
    these requests out, and the summary says how many."""
    if not (result_dir / run_files.METHOD_STATS).exists() or "reused_tokens" not in requests or not len(requests):
        return list(recorded)
    unrecorded = requests.loc[_without_stats(requests), "request_id"].astype(str)
    return list(dict.fromkeys([*recorded, *unrecorded]))


def _without_stats(requests: pd.DataFrame) -> pd.Series:
    """Successful requests whose records hold no method stats (reuse figures leave them out)."""
    return requests["success"] & requests["reused_tokens"].isna()


def _rank_mismatched(requests: pd.DataFrame) -> int:
    """Requests whose tensor-parallel ranks decided differently (should always be 0)."""
    if "method_stats" not in requests or not len(requests):
        return 0
    return int(sum("rank_mismatch" in json.loads(s) for s in requests["method_stats"].dropna()))


_ADDED_OVER_SEGMENTS = {"store_evictions", "store_refused", "prefix_cache_hits", "prefix_cache_queries",
                        "num_preemptions"}


def _over_segments(per_segment: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its segments': counts added, peaks the largest (a dict of peaks,
    key by key); None where no segment reported."""
    combined: dict[str, Any] = {}
    for key in per_segment[0]:
        values = [figures[key] for figures in per_segment if figures.get(key) is not None]
        if not values:
            combined[key] = None
        elif isinstance(values[0], dict):
            combined[key] = {name: max((v[name] for v in values if v.get(name) is not None), default=None)
                             for name in {n for v in values for n in v}}
        else:
            combined[key] = sum(values) if key in _ADDED_OVER_SEGMENTS else max(values)
    return combined


def read_config(result_dir: Path) -> dict[str, Any]:
    """config.json, which must be a JSON object (ValueError naming the file otherwise)."""
    path = result_dir / run_files.CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not the object a run's config is")
    return config


def summarize_run(result_dir: Path) -> dict[str, Any]:
    """The summary of the run in `result_dir` (vLLM's `bench serve` keys plus kvbench's), from
    its requests as run_files.load_requests reads them (the journal when requests.parquet is
    missing, shorter or unreadable: `requests_source` says which)."""
    config = read_config(result_dir)
    read = run_files.load_requests(result_dir)
    requests = read.frame
    if len(requests):
        requests["success"] = requests["success"].astype(bool)
    answered = run_files.answered_requests(requests)  # in flight when an over-saturated run stopped: not failed
    stopped, requests = len(requests) - len(answered), answered
    segments = config.get("segments") or [{}]
    # each journal read once, then split by segment (a run resumed many times has many)
    metrics = run_files.read_jsonl(result_dir / run_files.SERVER_METRICS)
    method_stats = run_files.read_jsonl(result_dir / run_files.METHOD_STATS)
    last = segments[-1]
    missing = _stats_missing(result_dir, requests, last.get("method_stats_missing") or [])
    status = str(last.get("status") or "")
    summary = {
        "date": config["date"], "run_id": config["run_id"], "backend": "vllm", "method": config["method"],
        "label": config.get("label"), "model_id": config.get("model"), "tokenizer_id": config.get("tokenizer"),
        "num_prompts": int(len(requests)), "request_rate": config.get("request_rate"),
        "burstiness": config.get("burstiness"), "max_concurrency": config.get("max_concurrency"),
        **(config.get("metadata") or {}),
        # A resumed run's rates are over its active time: the segments' replay time added up,
        # the pause between an interruption and its resume left out (named below).
        **summarize(requests, sum(s.get("duration_s", 0.0) for s in segments),
                    config.get("metric_percentiles") or [50.0, 90.0, 99.0], config.get("goodput") or {}),
        "duration_basis": ("active: its own turns of an interleaved comparison" if config.get("interleaved") else
                           "active" if len(segments) == 1 else f"active: {len(segments)} segments added, pauses left out"),
        "segment_durations_s": [s.get("duration_s") for s in segments],
        # the warm-ups' wall time (the first segment's: a resumed run warms up again), and per warm-up
        "warmup_s": segments[0].get("warmup_s"),
        "warmup_per_trajectory_s": (segments[0]["warmup_s"] / segments[0]["warmup_trajectories"]
                                    if segments[0].get("warmup_trajectories") else None),
        **_over_segments([server_figures(result_dir, i, metrics) for i in range(len(segments))]),
        # what else the machine did meanwhile (replay/machine_load.py): timings taken under load are flagged
        **load_figures(run_files.read_jsonl(result_dir / run_files.MACHINE_LOAD)),
        # store and method state over every segment (each resets the store: peaks are the
        # largest of any segment, counts their sum)
        **_over_segments([store_figures(result_dir, i, method_stats) for i in range(len(segments))]),
        "rank_mismatched_requests": _rank_mismatched(requests),
        **shared_tier_figures(method_stats, metrics, None),  # (per reused token: below, once summed)
        **read_task_figures(result_dir),  # a task trace's accuracy, once scored
        **read_quality_figures(result_dir),  # outputs against a reference run, once compared
        # successful requests whose method stats never reached the client (their server died
        # before it reported them): realized rho and the reuse columns leave them out
        "method_stats_missing": len(missing),
        "method_stats_missing_requests": missing[:MAX_LISTED_MISSING],
        "aborted": last.get("aborted"),
        # Over-saturated (kvbench.replay.saturation): the run stopped early; its figures describe
        # a growing queue, not a steady state. The requests it stopped in flight are not failures.
        "saturated": last.get("status") == "saturated",
        "saturation": last.get("saturation"),
        "saturation_stopped_requests": stopped,
        "interrupted": status.removeprefix("interrupted by ") if status.startswith("interrupted by ") else None,
        "segments": len(config.get("segments") or []),
        "requests_source": read.source,
        "config": config,
    }
    summary.update(memory_figures(summary.pop("device_memory"), summary.get("method_store_peak_bytes"),
                                  summary.get("method_state_bytes")))
    if "shared_remote_bytes" in summary and summary.get("reused_tokens"):
        summary["shared_remote_bytes_per_reused_token"] = summary["shared_remote_bytes"] / summary["reused_tokens"]
    # the reuse share over the requests whose stats were counted (those without add shared tokens
    # and no reuse: a full disk's lost stats would read as reuse that never happened)
    counted = (int(requests.loc[requests["success"] & ~_without_stats(requests), "shared_tokens"].sum())
               if missing and "reused_tokens" in requests else None)
    return {**summary, **cache_hit_figures(summary, counted)}


def cache_hit_figures(summary: dict[str, Any], shared_counted: int | None = None) -> dict[str, float | None]:
    """The two hit rates users ask for: vLLM's prefix-cache hits over its queries (tokens, from
    its /metrics, every server), and the method's reuse share: rows served from reuse over the
    shared tokens of the successful requests (`shared_counted`: of those whose method stats were
    counted; realized rho is over those a source held)."""
    hits, queries = summary.get("prefix_cache_hits"), summary.get("prefix_cache_queries")
    reused = summary.get("reused_tokens")
    shared = shared_counted if shared_counted is not None else summary.get("shared_tokens")
    return {"prefix_cache_hit_share": hits / queries if hits is not None and queries else None,
            "reuse_share": reused / shared if reused is not None and shared else None}


def _recorded_prompts(result_dir: Path) -> int:
    """num_prompts of the summary on disk (0 when there is none, or it is unreadable)."""
    try:
        earlier = json.loads((result_dir / run_files.SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    prompts = earlier.get("num_prompts") if isinstance(earlier, dict) else None
    return prompts if isinstance(prompts, int) and not isinstance(prompts, bool) else 0


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_summary(result_dir: Path) -> dict[str, Any]:
    """Compute the run's summary and write it to `summary.json`; returns it. A summary of no
    request never replaces one of some (ValueError: the run's records are gone or unreadable)."""
    summary = summarize_run(result_dir)
    if summary["num_prompts"] == 0 and (earlier := _recorded_prompts(result_dir)):
        raise ValueError(f"{result_dir} holds no request record now, and its summary.json counts {earlier}: "
                         "kept that summary (are requests.jsonl and requests.parquet damaged?)")
    run_files.write_text_atomic(result_dir / run_files.SUMMARY, json.dumps(summary, indent=2, default=_json_default) + "\n")
    return summary
