"""kvbench's reuse counters on vLLM's connector-stats path and `/metrics` (no engine)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvbench.methods.connector.counters import STORE_BYTES, ReuseCounters
from kvbench.methods.connector.metrics import KVBenchConnectorStats, KVBenchPromMetrics


def test_rank_zero_counts_requests_and_every_rank_its_store() -> None:
    counters = ReuseCounters()
    counters.add_request({"claimed": True, "reused_tokens": 90, "recomputed_tokens": 9, "eligible_tokens": 90})
    counters.add_request({"claimed": False, "reused_tokens": 0, "recomputed_tokens": 50, "fallback": None})
    counters.add_save(4096)
    assert counters.take(rank=0) == {"requests": 2, "claimed_requests": 1, "reused_tokens": 90, "recomputed_tokens": 59,
                                     "eligible_tokens": 90, "source_missing_tokens": 0, "exact_prefix_tokens": 0,
                                     "fallbacks": 0, "saves": 1, STORE_BYTES: {"0": 4096}}
    counters.add_request({"reused_tokens": 5})
    counters.add_save(2048)
    assert counters.take(rank=1) == {STORE_BYTES: {"1": 2048}}  # rank 0 counts the request for both
    assert counters.take(rank=0) is None


def test_stats_add_up_over_workers_and_steps_and_reach_prometheus() -> None:
    step1 = KVBenchConnectorStats(data={"requests": 2, "reused_tokens": 90, STORE_BYTES: {"0": 100, "1": 100}})
    step2 = KVBenchConnectorStats(data={"requests": 1, "reused_tokens": 10, "fallbacks": 1, STORE_BYTES: {"0": 300}})
    total = step1.aggregate(step2)
    assert total.reduce() == {"requests": 3, "reused_tokens": 100, "fallbacks": 1, "store_bytes": 400}
    assert KVBenchConnectorStats().is_empty()

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    prom = KVBenchPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                              {0: ["m", "0"]})
    prom.observe(step1.to_dict())
    prom.observe({"reused_tokens": 5})
    text = generate_latest(registry).decode()
    assert 'vllm:kvbench_reused_tokens_total{engine="0",model_name="m"} 105.0' in text
    assert 'vllm:kvbench_store_bytes{engine="0",model_name="m"} 400.0' in text
