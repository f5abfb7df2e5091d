"""The reuse counters the connector reports on vLLM's connector-stats path (kvbench.methods.
connector.metrics turns them into `vllm:kvbench_*` Prometheus metrics); vLLM-free, so the worker
side counts without importing vLLM."""

from __future__ import annotations

from typing import Any

# Counters: key in the stats data -> (Prometheus name, what it counts)
COUNTERS: dict[str, tuple[str, str]] = {
    "requests": ("vllm:kvbench_requests_total", "Requests with a kvbench plan the connector finished with."),
    "claimed_requests": ("vllm:kvbench_claimed_requests_total",
                         "Of them, requests the connector loaded (its method reused something for them)."),
    "reused_tokens": ("vllm:kvbench_reused_tokens_total", "Prompt rows served from another request's saved cache."),
    "recomputed_tokens": ("vllm:kvbench_recomputed_tokens_total", "Prompt rows computed (by vLLM or the connector)."),
    "eligible_tokens": ("vllm:kvbench_eligible_tokens_total",
                        "Prompt rows a saved source held with identical tokens (what reuse could serve)."),
    "source_missing_tokens": ("vllm:kvbench_source_missing_tokens_total",
                              "Shared rows whose named source the store no longer held."),
    "exact_prefix_tokens": ("vllm:kvbench_exact_prefix_tokens_total",
                            "Rows copied as they are from an earlier cache's exact prefix."),
    "fallbacks": ("vllm:kvbench_fallbacks_total", "Loads that failed; vLLM recomputed the request densely."),
    "saves": ("vllm:kvbench_saves_total", "Finished requests copied into the segment store."),
    # the shared tier under the store (kvbench.methods.core.tiered_store), lookups by key
    "shared_local_hits": ("vllm:kvbench_shared_local_hits_total", "Source lookups this instance's store held."),
    "shared_remote_hits": ("vllm:kvbench_shared_remote_hits_total", "Source lookups served from the shared tier."),
    "shared_misses": ("vllm:kvbench_shared_misses_total", "Source lookups neither tier held (rows computed densely)."),
    "shared_rejected": ("vllm:kvbench_shared_rejected_total",
                        "Shared-tier entries refused (corrupt, another model or codec): computed densely."),
    "shared_remote_bytes": ("vllm:kvbench_shared_remote_bytes_total", "Bytes read from the shared tier."),
    "shared_puts": ("vllm:kvbench_shared_puts_total", "Saved caches put in the shared tier."),
    "shared_put_bytes": ("vllm:kvbench_shared_put_bytes_total", "Bytes put in the shared tier."),
    "shared_put_failures": ("vllm:kvbench_shared_put_failures_total", "Puts the shared tier refused."),
}
# Store bytes per tensor-parallel rank: the latest report of each, summed in the gauge.
STORE_BYTES = "store_bytes_by_rank"


def request_counts(stats: dict[str, Any]) -> dict[str, int]:
    """One request's contribution to the counters, from its LoadStats (kvbench.contracts)."""
    return {"requests": 1, "claimed_requests": int(stats.get("claimed", True)),
            **{key: int(stats.get(key) or 0) for key in ("reused_tokens", "recomputed_tokens", "eligible_tokens",
                                                         "source_missing_tokens", "exact_prefix_tokens")},
            "fallbacks": int(stats.get("fallback") == "dense")}


class ReuseCounters:
    """What one worker counted since vLLM last took its stats (once per engine step). Request
    counters come from tensor-parallel rank 0 only (every rank sees every request); each rank
    reports its own store size."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.store_bytes: int | None = None

    def add_request(self, stats: dict[str, Any]) -> None:
        for key, value in request_counts(stats).items():
            self.counts[key] = self.counts.get(key, 0) + value

    def add_counts(self, counts: dict[str, int]) -> None:
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value

    def add_save(self, store_bytes: int) -> None:
        self.counts["saves"] = self.counts.get("saves", 0) + 1
        self.store_bytes = store_bytes

    def take(self, rank: int) -> dict[str, Any] | None:
        """The counts since the last take (None: nothing new), then zero."""
        data: dict[str, Any] = dict(self.counts) if rank == 0 else {}
        if self.store_bytes is not None:
            data[STORE_BYTES] = {str(rank): self.store_bytes}
        self.counts, self.store_bytes = {}, None
        return data or None
