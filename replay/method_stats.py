"""The connector's per-request stats and state bytes, collected while a run goes on.

The workers keep what each request's load did (reused / recomputed tokens, gate decisions) in
memory until asked. Asked only at the end, a crash of the client or the server lost them; so the
replayer polls every few seconds, and every answer is appended to `method_stats.jsonl` before it
is used. A resumed run reads that journal back, so no request loses stats it had reported.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.contracts import WorkerStats

logger = logging.getLogger(__name__)

# Per-request stats every tensor-parallel rank must agree on: what was reused or computed, and
# each segment's decision. Timings and bytes differ between ranks by nature.
RANK_INVARIANT_STATS = ("reused_tokens", "recomputed_tokens", "fallback")

FetchStats = Callable[[str], Awaitable[list[WorkerStats]]]  # url -> one answer per worker, cleared


def rank_mismatch(per_rank: list[dict[str, Any]]) -> list[str]:
    """Names of the stats in which the ranks' views of one request differ (empty: they agree)."""
    first, differ = per_rank[0], []
    for name in RANK_INVARIANT_STATS:
        if any(stats.get(name) != first.get(name) for stats in per_rank[1:]):
            differ.append(name)
    decisions = [[(d.get("id"), d.get("decision")) for d in stats.get("decisions", [])] for stats in per_rank]
    if any(d != decisions[0] for d in decisions[1:]):
        differ.append("decisions")
    entropies = [[d.get("entropy") for d in stats.get("decisions", [])] for stats in per_rank]
    if any(e != entropies[0] for e in entropies[1:]):
        differ.append("entropy")
    for name in ("blend", "relay"):  # selective recomputation: the same rows picked everywhere
        for field_name in ("picked_tokens", "picked_digest"):
            if any(stats.get(name, {}).get(field_name) != first.get(name, {}).get(field_name)
                   for stats in per_rank[1:]):
                differ.append(f"{name}.{field_name}")
    return differ


@dataclass
class ServerState:
    """One server's store and method-state figures since the run's reset, as journaled (a "state"
    line; `kvbench.analysis.summary` takes the run's figures from these lines)."""

    store_bytes: int = 0
    store_peak_bytes: int = 0
    store_evictions: int = 0
    store_refused: int = 0
    method_state_bytes: dict[str, int] = field(default_factory=dict)
    deferred_s: float = 0.0  # the method's deferred work (anchor building, prematching), slowest rank
    poll_s: float = 0.0  # this poll's round trip (the engine answers it between two steps)
    # the shared tier's figures since the reset (rank 0's; kvbench.analysis.shared_tier), None without one
    shared_tier: dict[str, Any] | None = None
    # what the method shared with other instances through it (anchor pools; rank 0's), None without
    shared_state: dict[str, Any] | None = None


# the request columns `MethodStatsCollector.apply` fills from the connector's stats
STATS_FIELDS = ("reused_tokens", "eligible_tokens", "recomputed_tokens", "source_missing_tokens",
                "prefix_cached_tokens", "method_stats")


@dataclass
class MethodStatsCollector:
    """Polls `kvbench_stats` (clearing what it got), journals every answer, merges per request."""

    result_dir: Path
    base_urls: list[str]
    fetch: FetchStats
    by_request: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.result_dir / run_files.METHOD_STATS

    def reused_tokens(self) -> int:
        """Rows the method served from reuse, over the requests reported so far."""
        return sum(int(stats.get("reused_tokens") or 0) for stats in self.by_request.values())

    def load(self, request_ids: set[str]) -> None:
        """Stats an earlier segment of this run journaled, for the requests kept from it."""
        for entry in run_files.read_jsonl(self.path):  # a torn last poll's requests count as missing
            if entry.get("kind") == "request" and entry.get("request_id") in request_ids:
                self._merge(entry["request_id"], entry["stats"])

    def _merge(self, request_id: str, stats: dict[str, Any]) -> None:
        # A request's stats arrive in parts (its load, then its save): later parts add keys.
        self.by_request[request_id] = {**self.by_request.get(request_id, {}), **stats}

    async def poll(self, segment: int, t_s: float) -> None:
        """Ask every server for what it has not reported yet; journal it (with the segment and
        the seconds since its start), then merge it."""
        for url in self.base_urls:
            started = time.perf_counter()
            workers = await self.fetch(url)
            if workers:
                self._take(url, workers, segment, t_s, time.perf_counter() - started)

    def _take(self, url: str, workers: list[WorkerStats], segment: int, t_s: float, poll_s: float = 0.0) -> None:
        """A tensor-parallel server answers once per rank: each holds a shard of every cache, so
        bytes add up over its ranks, and the ranks must have decided alike (the first rank's
        stats are kept; a disagreement is recorded)."""
        lines = []
        for key, load_stats in workers[0].requests.items():
            stats: dict[str, Any] = dict(load_stats)
            if len(workers) > 1:
                stats["tp_ranks"] = len(workers)
                if mismatch := rank_mismatch([dict(w.requests.get(key, {})) for w in workers]):
                    stats["rank_mismatch"] = mismatch
                    logger.warning("request %s: tensor-parallel ranks decided differently: %s", key, mismatch)
            lines.append({"kind": "request", "request_id": key, "stats": stats})
        state = ServerState(
            store_bytes=sum(w.store_bytes for w in workers),
            store_peak_bytes=sum(w.store_peak_bytes for w in workers),
            store_evictions=workers[0].store_evictions,
            store_refused=workers[0].store_refused,
            method_state_bytes={name: sum(w.method_state_bytes.get(name, 0) for w in workers)
                                for name in workers[0].method_state_bytes},
            deferred_s=max(float(w.extra.get("deferred_s", 0.0)) for w in workers), poll_s=round(poll_s, 6),
            shared_tier=workers[0].extra.get("shared_tier"), shared_state=workers[0].extra.get("shared_state"))
        lines.append({"kind": "state", "segment": segment, "server_url": url, "t_s": round(t_s, 3),
                      **state.__dict__})
        with open(self.path, "a", encoding="utf-8") as journal:  # on disk before it is used
            journal.write("".join(json.dumps(line) + "\n" for line in lines))
        for line in lines[:-1]:
            self._merge(line["request_id"], line["stats"])

    def apply(self, records: list[dict[str, Any]]) -> list[str]:
        """Copy the stats into the records; returns the ids of the successful requests that have
        none (their server never reported them: it died before the next poll)."""
        missing = []
        for record in records:
            stats = self.by_request.get(record["request_id"])
            if stats is None or "reused_tokens" not in stats:
                if record["success"] and record.get("reused_tokens") is None:
                    missing.append(record["request_id"])
                continue
            record["reused_tokens"] = stats["reused_tokens"]
            record["eligible_tokens"] = stats.get("eligible_tokens")
            record["recomputed_tokens"] = stats["recomputed_tokens"]
            record["source_missing_tokens"] = stats.get("source_missing_tokens")
            # vLLM counts the connector's claims as cached too; its own prefix cache is `local_tokens`,
            # to which the rows the connector copied from an earlier cache's exact prefix add alike
            local = stats.get("local_tokens")
            record["prefix_cached_tokens"] = None if local is None else local + stats.get("exact_prefix_tokens", 0)
            record["method_stats"] = json.dumps(stats)
        return missing
