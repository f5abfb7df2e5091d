"""KVBenchConnector: the one vLLM V1 KV connector through which every sharing method runs.

A thin adapter: vLLM builds it once per role, and it builds the side that role needs, the
scheduler side (`scheduler.py`: claims, waits, pending saves) in the engine process or the
worker side (`worker.py`: caches, loads, saves, RPCs) in each worker, and forwards vLLM's calls
to it. A method is chosen by `kv_connector_extra_config` (`settings.py`) and decides what K/V
to place; `materialize.py` places it. Any error inside a load reports the request's blocks as
failed, and vLLM (load failure policy "recompute") recomputes them itself: a dense fallback
that never leaves wrong K/V.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvbench.methods.connector.metadata import KVBenchMetadata
from kvbench.methods.connector.metrics import KVBenchConnectorStats, KVBenchPromMetrics
from kvbench.methods.connector.remote_sources import RemoteSources
from kvbench.methods.connector.scheduler import ConnectorScheduler
from kvbench.methods.connector.settings import ConnectorSettings, load_method
from kvbench.methods.connector.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvbench.connector")


class KVBenchConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config or {})
        method = load_method(settings)  # validates the parameters on both sides
        self.scheduler_side: ConnectorScheduler | None = None
        self.worker_side: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            remote = None if settings.shared_tier is None else RemoteSources.connect(
                settings.shared_tier, vllm_config.model_config.model, vllm_config.parallel_config.tensor_parallel_size)
            self.scheduler_side = ConnectorScheduler(settings, method, remote)
        else:
            self.worker_side = ConnectorWorker(settings, method, vllm_config.cache_config.block_size,
                                               vllm_config.compilation_config.static_forward_context,
                                               model_path=vllm_config.model_config.model)
        logger.info("kvbench connector (%s) for method %s, params %s", role.name, settings.method, method.params)

    @property
    def scheduler(self) -> ConnectorScheduler:
        assert self.scheduler_side is not None, "a scheduler-side call on the worker-side connector"
        return self.scheduler_side

    @property
    def worker(self) -> ConnectorWorker:
        assert self.worker_side is not None, "a worker-side call on the scheduler-side connector"
        return self.worker_side

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ---------------------------------------------------------------- worker side
    def _meta(self) -> KVBenchMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBenchMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # sync loads complete in start_load_kv, before the forward; async ones are not scheduled yet

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # finished requests are copied once, from their held blocks

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker.get_finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving, failed = self.worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_worker_meta()

    # ---------------------------------------------------------------- vLLM's stats path (/metrics)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is None:  # the scheduler side counts nothing of its own
            return None
        data = self.worker_side.take_reuse_counts()
        return None if data is None else KVBenchConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVBenchConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVBenchPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
