"""What the shared tier (Mooncake Store under the connectors' segment stores) did in a run:
lookups that hit locally, remotely or missed, the bytes moved, the remote get's latency, the puts,
and the store's memory. From the connector's journaled state lines (each server's rank-0 figures
since the run's reset, the latest of each server taken) and the master's sampled metrics page."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

SUMMED = ("local_hits", "remote_hits", "misses", "rejected", "remote_bytes", "puts", "put_bytes", "put_failures")


def shared_tier_figures(method_stats: list[dict[str, Any]], metrics: list[dict[str, Any]],
                        reused_tokens: int | None) -> dict[str, Any]:
    """`shared_*` summary keys; {} for a run without a shared tier. Over the run's last segment (each
    segment resets the store)."""
    states = [e for e in method_stats if e.get("kind") == "state" and e.get("shared_tier")]
    if not states:
        return {}
    last = max(e.get("segment", 0) for e in states)
    latest = {e["server_url"]: e["shared_tier"] for e in states if e.get("segment", 0) == last}
    out: dict[str, Any] = {f"shared_{name}": sum(int(t.get(name, 0)) for t in latest.values()) for name in SUMMED}
    gets_ms = np.array([s * 1e3 for t in latest.values() for s in t.get("get_s", [])], dtype=float)
    out["shared_remote_gets"] = int(gets_ms.size)
    for p in (50, 90):
        out[f"p{p}_shared_get_ms"] = float(np.percentile(gets_ms, p)) if gets_ms.size else None
    out["shared_put_ms_total"] = sum(float(t.get("put_s", 0.0)) for t in latest.values()) * 1e3
    lookups = out["shared_local_hits"] + out["shared_remote_hits"] + out["shared_misses"]
    out["shared_remote_hit_share"] = out["shared_remote_hits"] / lookups if lookups else None
    out["shared_remote_bytes_per_reused_token"] = out["shared_remote_bytes"] / reused_tokens if reused_tokens else None
    allocated = [s["master_allocated_bytes"] for s in metrics if "master_allocated_bytes" in s
                 and s.get("segment", 0) == last]
    out["shared_store_peak_bytes"] = int(max(allocated)) if allocated else None
    return {**out, **_anchor_figures(method_stats, last)}


# What the methods' shared anchor pools moved through the tier (kvbench.methods.delta.shared_anchors),
# summed over the servers: beside the caches' bytes above, the anchors' own.
ANCHOR_FIGURES = {"puts": "shared_anchor_puts", "put_bytes": "shared_anchor_put_bytes",
                  "remote_bytes": "shared_anchor_remote_bytes", "imported": "shared_anchors_imported",
                  "rejected": "shared_anchors_rejected"}


def _anchor_figures(method_stats: list[dict[str, Any]], segment: int) -> dict[str, Any]:
    latest = {e["server_url"]: e["shared_state"] for e in method_stats
              if e.get("kind") == "state" and e.get("shared_state") and e.get("segment", 0) == segment}
    if not latest:
        return {}
    return {key: sum(int(s.get(name, 0)) for s in latest.values()) for name, key in ANCHOR_FIGURES.items()}


def _mib(value: Any) -> float | None:
    return None if value is None else float(value) / 2**20


def shared_tier_table(runs: list[Any]) -> pd.DataFrame:
    """One row per run that had a shared tier (kvbench.analysis.runs.Run): what each tier did."""
    rows = []
    for run in runs:
        s = run.summary
        if "shared_remote_hits" not in s:
            continue
        config = s.get("config") or {}
        puts = s.get("shared_puts") or 0
        rows.append({
            "run": run.cell, "instances": config.get("instances") or len(config.get("base_urls") or []),
            "routing": config.get("routing"), "local_hits": s["shared_local_hits"], "remote_hits": s["shared_remote_hits"],
            "misses": s["shared_misses"], "rejected": s["shared_rejected"],
            "remote_mib": s["shared_remote_bytes"] / 2**20, "p50_shared_get_ms": s.get("p50_shared_get_ms"),
            "p90_shared_get_ms": s.get("p90_shared_get_ms"), "puts": puts, "put_mib": s["shared_put_bytes"] / 2**20,
            "ms_per_put": s["shared_put_ms_total"] / puts if puts else None,
            "remote_bytes_per_reused_token": s.get("shared_remote_bytes_per_reused_token"),
            "shared_store_peak_mib": None if s.get("shared_store_peak_bytes") is None else s["shared_store_peak_bytes"] / 2**20,
            "anchor_put_mib": _mib(s.get("shared_anchor_put_bytes")),
            "anchor_remote_mib": _mib(s.get("shared_anchor_remote_bytes")),
            "anchors_imported": s.get("shared_anchors_imported"), "anchors_rejected": s.get("shared_anchors_rejected")})
    return pd.DataFrame(rows)
