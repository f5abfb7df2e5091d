"""The connector's scheduler side (engine process): claims, waits and pending saves.

For a request its method reuses something for (by the plan's claim policy, kvbench.contracts:
by default `SharingMethod.loads_request`), claim every prompt token vLLM's prefix cache does not
hold but the last as an external hit, so the worker side loads them before the forward; wait
(claim None) while a source cache is still being produced. Any other request is vLLM's own
prefill, in its own batches. Hold finished requests' blocks until the worker has copied them into
the store.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvbench.contracts import PLAN_KEY, ContractError, Plan
from kvbench.methods.base import SharingMethod
from kvbench.methods.connector.metadata import KVBenchMetadata, KVBenchWorkerMetadata
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.connector.specs import LoadSpec, SaveSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvbench.connector")


class ConnectorScheduler:
    def __init__(self, settings: ConnectorSettings, method: SharingMethod) -> None:
        """`method`: built from the same settings as the workers' (never bound to a model here)."""
        self.settings, self.method = settings, method
        self._pending_loads: dict[str, LoadSpec] = {}
        self._pending_saves: list[SaveSpec] = []
        self._unsaved_keys: set[str] = set()  # a producer is running or its save is unconfirmed
        self._failed_loads: set[str] = set()  # async loads that failed: vLLM computes them itself
        self._bad_plans: set[str] = set()  # requests whose plan was refused (logged once each)
        self._vllm_prefills: dict[str, int] = {}  # unclaimed requests -> rows vLLM's prefix cache held
        self._waiting_since: dict[str, float] = {}  # requests held back for an unsaved source -> since when

    def plan_of(self, request: Request) -> Plan | None:
        """The request's plan; a plan this kvbench cannot read is logged and the request served
        as plain vLLM (one bad request never takes the engine down)."""
        try:
            return Plan.from_params(request.kv_transfer_params)
        except ContractError as exc:
            if request.request_id not in self._bad_plans:
                self._bad_plans.add(request.request_id)
                logger.error("request %s: unreadable kvbench plan, served without the connector: %s",
                             request.request_id, exc)
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self.plan_of(request)
        if plan is None:
            return 0, False
        if not plan.claimed(self.method.loads_request):  # vLLM prefills it in its own batches; it is still saved when it finishes
            self._vllm_prefills[request.request_id] = num_computed_tokens
            return 0, False
        if request.request_id in self._failed_loads:  # asked again after a failed async load
            self._failed_loads.discard(request.request_id)
            return 0, False
        if plan.waits_for & self._unsaved_keys:
            self._waiting_since.setdefault(request.request_id, time.perf_counter())
            return None, False  # a source is still being produced: ask again next step
        count = max(0, request.num_prompt_tokens - 1 - num_computed_tokens)
        return count, count > 0 and self.settings.asynchronous

    def on_new_request(self, request: Request) -> None:
        plan = self.plan_of(request)
        if plan is not None and plan.saved_key:
            self._unsaved_keys.add(plan.saved_key)  # consumers arriving now must wait for it

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        plan = self.plan_of(request)
        assert plan is not None, "only requests with a plan claim tokens"
        num_target = request.num_prompt_tokens - 1
        since = self._waiting_since.pop(request.request_id, None)
        self._pending_loads[request.request_id] = LoadSpec(
            req_id=request.request_id, token_ids=list(request.prompt_token_ids or []),
            block_ids=list(blocks.get_block_ids()[0]), num_local=num_target - num_external_tokens,
            num_target=num_target, plan=plan, source_wait_s=0.0 if since is None else time.perf_counter() - since)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBenchMetadata:
        meta = KVBenchMetadata(scheduled_req_ids=frozenset(scheduler_output.num_scheduled_tokens))
        for new in scheduler_output.scheduled_new_reqs:
            if (spec := self._pending_loads.pop(new.req_id, None)) is not None:
                spec.block_ids = list(new.block_ids[0])
                meta.loads.append(spec)
        # A preempted request comes back through get_num_new_matched_tokens and is listed among the
        # cached requests as resumed, with all its block ids: materialize it again.
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids and (spec := self._pending_loads.pop(req_id, None)) is not None:
                spec.block_ids = list(cached.new_block_ids[index][0])
                meta.loads.append(spec)
        if self.settings.asynchronous:  # the requests wait unscheduled
            meta.loads.extend(self._pending_loads.values())
        self._pending_loads.clear()
        meta.saves, self._pending_saves = self._pending_saves, []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KVBenchWorkerMetadata):
            self._unsaved_keys -= worker_meta.saved_keys
        self._failed_loads |= set(getattr(connector_output, "failed_recving", None) or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._failed_loads.discard(request.request_id)
        self._waiting_since.pop(request.request_id, None)
        prefix_cached = self._vllm_prefills.pop(request.request_id, None)
        plan = self.plan_of(request)
        self._bad_plans.discard(request.request_id)
        if plan is None or not plan.save_as:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED or request.num_computed_tokens == 0:
            self._unsaved_keys.discard(plan.save_as)  # never saved; do not block consumers
            return False, None
        # K/V exists for every computed token: the prompt and all generated tokens but the last.
        tokens = list(request.all_token_ids[: request.num_computed_tokens])
        # A request vLLM prefilled itself is reported at its save (no load saw it).
        unclaimed = None if prefix_cached is None else (request.num_prompt_tokens, prefix_cached)
        if not plan.keep_cache:  # nothing reads it: nothing is copied, its figures are still reported
            if unclaimed is None:
                return False, None  # its load reported them: vLLM frees its blocks now
            # vLLM prefilled it: the worker reports its figures in the next step, which vLLM runs
            # (the blocks stay held until then) even when no other request is left
            self._pending_saves.append(SaveSpec(request.request_id, plan.save_as, [], [], unclaimed, keep=False))
            return True, None
        self._pending_saves.append(SaveSpec(request.request_id, plan.save_as, tokens, list(block_ids), unclaimed,
                                            adapter=plan.adapter))
        return True, {PLAN_KEY: {"save_as": plan.save_as, "num_tokens": len(tokens)}}
