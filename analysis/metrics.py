"""Metric definitions shared by the replayer's summary.json and every report.

Follows `vllm bench serve`: latency aggregates over successful requests only, in ms; ITL pools
every inter-chunk gap; TPOT is per request. Adds the paper's trajectory-averaged TTFT.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from kvbench.analysis.goodput import goodput_figures

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile_key(p: float) -> str:
    """vLLM's naming: p99, p99.9."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < v < 100 for v in values):
        raise ValueError(f"--metric-percentiles must lie strictly between 0 and 100, got {text!r}")
    return values


def _stats(values: np.ndarray, name: str, percentiles: list[float]) -> dict[str, float]:
    if len(values) == 0:
        nan = float("nan")
        return {f"mean_{name}_ms": nan, f"median_{name}_ms": nan, f"std_{name}_ms": nan,
                **{f"{percentile_key(p)}_{name}_ms": nan for p in percentiles}}
    return {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(np.std(values)),
        **{f"{percentile_key(p)}_{name}_ms": float(np.percentile(values, p)) for p in percentiles},
    }


def trajectory_table(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per trajectory whose turns all succeeded: mean TTFT, E2E and token throughput."""
    ok = requests.groupby("trajectory_id")["success"].transform("all")
    done = requests[ok]
    if done.empty:
        return pd.DataFrame(columns=["trajectory_id", "mean_ttft_ms", "e2e_ms", "tokens", "token_throughput"])
    grouped = done.groupby("trajectory_id")
    table = pd.DataFrame({
        "mean_ttft_ms": grouped["ttft_ms"].mean(),
        "e2e_ms": (grouped["end_ns"].max() - grouped["scheduled_ns"].min()) / 1e6,
        "tokens": grouped["prompt_tokens"].sum() + grouped["output_tokens"].sum(),
    })
    table["token_throughput"] = table["tokens"] / (table["e2e_ms"] / 1e3)
    return table.reset_index()


def _reuse_columns(requests: pd.DataFrame) -> tuple[pd.Series, pd.Series, pd.Series] | None:
    """(reused, could have been reused by the store's grace, lost to the store's cap) per request
    the method reported on; None without method stats."""
    if not len(requests) or "reused_tokens" not in requests or requests["reused_tokens"].isna().all():
        return None
    with_stats = requests[requests["reused_tokens"].notna()]
    eligible = (with_stats["eligible_tokens"].fillna(with_stats["reusable_tokens"]) if "eligible_tokens" in with_stats
                else with_stats["reusable_tokens"])
    lost = (with_stats["source_missing_tokens"].fillna(0) if "source_missing_tokens" in with_stats
            else pd.Series(0, index=with_stats.index))
    return with_stats["reused_tokens"].astype(float), eligible.astype(float), lost.astype(float)


def realized_rho(requests: pd.DataFrame) -> float | None:
    """Shared PH tokens served by reuse / PH tokens the method could have served had the segment
    store kept every source (those it could serve, plus those whose source the store's cap had
    dropped). None without method stats. `eligible_rho` leaves the dropped ones out."""
    columns = _reuse_columns(requests)
    if columns is None:
        return None
    reused, eligible, lost = columns
    denominator = eligible.sum() + lost.sum()
    return float(reused.sum() / denominator) if denominator else None


def reuse_figures(requests: pd.DataFrame) -> dict[str, Any]:
    """`realized_rho` beside the store-limited view: `eligible_rho` (reused / what the store
    still held) and the reusable tokens lost to the store's cap (`reuse_lost_to_eviction_*`)."""
    columns = _reuse_columns(requests)
    if columns is None:
        return {"realized_rho": None, "eligible_rho": None, "reuse_lost_to_eviction_tokens": None,
                "reuse_lost_to_eviction_share": None, "reuse_lost_to_refusal_tokens": None,
                "reuse_lost_to_refusal_share": None}
    reused, eligible, lost = columns
    reusable = eligible.sum() + lost.sum()
    # Of the lost rows, those whose source was larger than the store's whole cap were refused at
    # save, not evicted later: a cap to raise, not a working set that outgrew it.
    refused = float(sum(s.get("source_refused_tokens", 0) for s in method_stats_of(requests)))
    evicted = lost.sum() - refused
    return {
        "realized_rho": float(reused.sum() / reusable) if reusable else None,
        "eligible_rho": float(reused.sum() / eligible.sum()) if eligible.sum() else None,
        "reuse_lost_to_eviction_tokens": int(evicted),
        "reuse_lost_to_eviction_share": float(evicted / reusable) if reusable else None,
        "reuse_lost_to_refusal_tokens": int(refused),
        "reuse_lost_to_refusal_share": float(refused / reusable) if reusable else None,
    }


def method_stats_of(requests: pd.DataFrame) -> pd.Series:
    """Each request's connector stats as a dict (empty where it has none), index-aligned."""
    raw = requests["method_stats"] if "method_stats" in requests else pd.Series(None, index=requests.index, dtype=object)
    return raw.map(lambda r: json.loads(r) if isinstance(r, str) else {})


# Decisions that sent a segment dense only because the method had learned nothing yet: an anchor
# pool holding fewer than two anchors (the delta methods' `dense_few_anchors`).
COLD_START_DECISIONS = frozenset({"dense_few_anchors"})


def cold_start_share(requests: pd.DataFrame) -> float | None:
    """Share of the method's segment decisions that went dense because its state was still empty
    (a cold start); None where the method reports no decisions."""
    decisions = [d.get("decision") for stats in method_stats_of(requests) for d in stats.get("decisions", [])]
    return sum(d in COLD_START_DECISIONS for d in decisions) / len(decisions) if decisions else None


def cold_start_trajectories(requests: pd.DataFrame) -> int | None:
    """Through how many measured trajectories (in arrival order) a decision still went dense for
    want of anchors: the place of the last one that had such a decision (0: none had); None where
    the method reports no decisions. As many more warm-ups would have filled the pools first."""
    if "method_stats" not in requests or "trajectory_id" not in requests:
        return None
    order = requests.sort_values("scheduled_ns") if "scheduled_ns" in requests else requests
    places = {t: i for i, t in enumerate(dict.fromkeys(order["trajectory_id"]), start=1)}
    decided, last = False, 0
    for trajectory, stats in zip(order["trajectory_id"], method_stats_of(order)):
        kinds = [d.get("decision") for d in stats.get("decisions", [])]
        decided |= bool(kinds)
        if any(kind in COLD_START_DECISIONS for kind in kinds):
            last = max(last, places[trajectory])
    return last if decided else None


def recompute_share(requests: pd.DataFrame) -> float | None:
    """Shared (token, layer) entries computed / all the method could have served from reuse
    (realized rho's denominator, in every layer): 1 - rho where each reused row is served in
    every layer, more where reused rows compute some layers (CacheBlend's first layers,
    DroidSpeak's group). None without method stats, or where a request reused rows but its
    connector did not count entries (runs recorded before the count)."""
    columns = _reuse_columns(requests)
    if columns is None:
        return None
    reused, eligible, lost = columns
    denominator = eligible.sum() + lost.sum()
    served = 0.0  # in whole-row units: entries / layers
    for stats, reused_rows in zip(method_stats_of(requests).loc[reused.index], reused, strict=True):
        if "served_entries" in stats:
            served += stats["served_entries"] / stats["layers"]
        elif reused_rows:
            return None
    return float(1 - served / denominator) if denominator else None


def store_codec_figures(requests: pd.DataFrame) -> dict[str, Any]:
    """From the connector's per-request stats: bytes the segment store held per stored token
    (measured from the tensors kept: K/V as stored, with scales and norms, and token ids), and
    compression / decompression time per 1K tokens. None where no request reported them."""
    totals = dict.fromkeys(("store_entry_bytes", "store_entry_tokens", "store_encode_s", "store_decode_s",
                            "store_decoded_tokens"), 0.0)
    seen = False
    for stats in method_stats_of(requests):
        for key in totals:
            if key in stats:
                totals[key] += float(stats[key])
                seen = True
    if not seen or not totals["store_entry_tokens"]:
        return {"store_bytes_per_token": None, "store_encode_ms_per_1k_tokens": None,
                "store_decode_ms_per_1k_tokens": None}
    return {
        "store_bytes_per_token": totals["store_entry_bytes"] / totals["store_entry_tokens"],
        "store_encode_ms_per_1k_tokens": 1e6 * totals["store_encode_s"] / totals["store_entry_tokens"],
        "store_decode_ms_per_1k_tokens": (1e6 * totals["store_decode_s"] / totals["store_decoded_tokens"]
                                          if totals["store_decoded_tokens"] else None),
    }


def summarize(requests: pd.DataFrame, duration_s: float, percentiles: list[float],
              goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """vLLM's summary keys plus kvbench's workflow (trajectory) and reuse figures, and goodput
    under the bounds `goodput` gives (kvbench.analysis.goodput)."""
    ok = requests[requests["success"]] if len(requests) else requests
    completed, failed = int(len(ok)), int(len(requests) - len(ok))
    total_input = int(ok["prompt_tokens"].sum()) if completed else 0
    total_output = int(ok["output_tokens"].sum()) if completed else 0
    duration_s = max(duration_s, 1e-9)
    itls = np.concatenate([np.asarray(x, dtype=float) for x in ok["itl_ms"]]) if completed else np.array([])
    summary: dict[str, Any] = {
        "completed": completed,
        "failed": failed,
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name in ("ttft", "tpot", "e2el"):
        column = ok[f"{name}_ms"].dropna().to_numpy(dtype=float) if completed else np.array([])
        summary |= _stats(column, name, percentiles)
    summary |= _stats(itls, "itl", percentiles)

    trajectories = trajectory_table(requests) if len(requests) else trajectory_table(
        pd.DataFrame(columns=["trajectory_id", "success"]))
    summary["completed_trajectories"] = int(len(trajectories))
    summary["failed_trajectories"] = int(requests["trajectory_id"].nunique() - len(trajectories)) if len(requests) else 0
    summary |= _stats(trajectories["mean_ttft_ms"].to_numpy(dtype=float), "trajectory_ttft", percentiles)
    summary["mean_trajectory_e2e_ms"] = float(trajectories["e2e_ms"].mean()) if len(trajectories) else math.nan
    # A workflow's makespan: its first arrival to its last agent's last token (what a user of a
    # multi-agent application waits), and the workflows finished per second.
    summary |= _stats(trajectories["e2e_ms"].to_numpy(dtype=float), "workflow", percentiles)
    summary["workflow_throughput"] = len(trajectories) / duration_s
    summary |= goodput_figures(requests, trajectories.set_index("trajectory_id")["e2e_ms"], duration_s, goodput or {})
    summary["mean_trajectory_token_throughput"] = (float(trajectories["token_throughput"].mean())
                                                   if len(trajectories) else math.nan)
    shared = int(ok["shared_tokens"].sum()) if completed else 0
    reusable = int(ok["reusable_tokens"].sum()) if completed else 0
    summary["shared_tokens"] = shared
    summary["reusable_tokens"] = reusable
    summary |= reuse_figures(ok)
    summary["recompute_share"] = recompute_share(ok)
    summary["cold_start_dense_share"] = cold_start_share(ok)
    summary["cold_start_trajectories"] = cold_start_trajectories(ok)
    # What vLLM's own prefix cache served, what the method reused and what was computed, apart:
    # vLLM's `cached_tokens` also counts every token a connector claimed.
    for column in ("cached_tokens", "prefix_cached_tokens", "reused_tokens", "recomputed_tokens"):
        values = ok[column].dropna() if completed and column in ok else pd.Series(dtype=float)
        summary[column] = int(values.sum()) if len(values) else None
    summary |= store_codec_figures(ok)
    prefix = ok["prefix_cached_tokens"] if completed and "prefix_cached_tokens" in ok else None
    if prefix is not None and prefix.notna().all():  # rows computed (by vLLM or the connector's forward)
        reused = ok["reused_tokens"].fillna(0) if "reused_tokens" in ok else 0
        summary["computed_prompt_tokens"] = int((ok["prompt_tokens"] - prefix - reused).sum())
    else:
        summary["computed_prompt_tokens"] = None
    return summary
