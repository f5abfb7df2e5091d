"""kvbench's reuse figures on vLLM's own connector-stats path: the workers' counts travel with each
engine step's output (`get_kv_connector_stats`), vLLM's scheduler aggregates them, and its stat
loggers log them and export them on `/metrics` (`build_prom_metrics`), so a Prometheus user of a
kvbench server sees what the connector reused.

Only totals travel this way. Per-request figures (each segment's decision, the gate, the step
timings) stay on kvbench's worker RPC (`kvbench_stats`), which the replayer polls: Prometheus
aggregates, and a benchmark needs each request's own record.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvbench.methods.connector.counters import COUNTERS, STORE_BYTES


class KVBenchConnectorStats(KVConnectorStats):
    """Counters since the last report (added up over steps and workers) and each rank's latest
    store size."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key == STORE_BYTES:
                self.data.setdefault(STORE_BYTES, {}).update(value)  # the later report of a rank wins
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {key: self.data[key] for key in COUNTERS if key in self.data}
        if STORE_BYTES in self.data:
            reduced["store_bytes"] = sum(self.data[STORE_BYTES].values())
        return reduced


class KVBenchPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvbench_*` counters and the segment store's size, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                          for key, (name, doc) in COUNTERS.items()}
        self._store_bytes = self._gauge_cls(name="vllm:kvbench_store_bytes",
                                            documentation="Bytes the connector's segment store holds (all ranks).",
                                            labelnames=labelnames, multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in (transfer_stats_data or {}).items():
            if key == STORE_BYTES:
                self._store_bytes.labels(*labels).set(sum(value.values()))
            elif key in self._counters and value:
                self._counters[key].labels(*labels).inc(value)
