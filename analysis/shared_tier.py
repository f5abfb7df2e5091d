"""What the shared tier (Mooncake Store under the connectors' segment stores) did in a run:
lookups that hit locally, remotely or missed, the bytes moved, the remote get's latency, the puts,
and the store's memory. From the connector's journaled state lines (each server's rank-0 figures
since the run's reset, the latest of each server taken) and the master's sampled metrics page."""

from __future__ import annotations

from typing import Any

import numpy as np

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
    return out
