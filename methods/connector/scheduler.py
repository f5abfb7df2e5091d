"""The connector's scheduler side (engine process): claims, waits and pending saves.

For a request its method reuses something for (by the plan's claim policy, kvbench.contracts:
by default `SharingMethod.loads_request`), claim every prompt token vLLM's prefix cache does not
hold but the last as an external hit, so the worker side loads them before the forward; wait
(claim None) while a source cache is still being produced. Any other request is vLLM's own
prefill, in its own batches. Hold finished requests' blocks until the worker has copied them into
the store.

A method that decides per segment whether to reuse (`SharingMethod.decides_before_claim`: a gate
that may send segments dense) is asked first: the request waits one engine step while the worker
decides (DecideSpec), and the claim then covers the rows up to the last one it reuses; vLLM
prefills the rest itself, in the same forward, at its own speed (a turn the gate sends wholly
dense is a plain vLLM prefill). The scheduler follows every request it claimed or had decided:
its blocks, and the step whose forward finishes its prompt (KVBenchMetadata.prefilled), when the
worker may read its final rows.

A request a concurrent turn may read (Plan.readable_after_prefill) is followed too, and its prompt
is saved right after that forward (KVBenchMetadata.prompt_saves): a reader whose segments lie in
those rows (Plan.rows_read_from) goes ahead then, instead of waiting for the source's decode.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.contracts import PLAN_KEY, ContractError, Plan
from kvbench.methods.api.base import SharingMethod
from kvbench.methods.connector.metadata import KVBenchMetadata, KVBenchWorkerMetadata
from kvbench.methods.connector.remote_sources import RemoteSources
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.connector.specs import DecideSpec, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvbench.connector")

# How long a request waits for a source sent just before it (Plan.sources_in_flight) to reach the
# engine; one that never comes (its request failed on the way) then costs no more than this.
IN_FLIGHT_GRACE_S = 2.0
MAX_REGISTERED_KEYS = 100_000  # keys of requests seen, remembered to tell "saved" from "not here yet"


@dataclass
class FollowedRequest:
    """A request the connector claimed or had decided: its prompt length and the blocks it holds
    (as vLLM's scheduler outputs hand them out, chunk by chunk)."""

    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    prefilled: bool = False
    prompt_save: SaveSpec | None = None  # its prompt, saved once computed (Plan.readable_after_prefill)


class ConnectorScheduler:
    def __init__(self, settings: ConnectorSettings, method: SharingMethod, remote: RemoteSources | None = None) -> None:
        """`method`: built from the same settings as the workers' (never bound to a model here);
        `remote`: the shared tier's sources, when there is one."""
        self.settings, self.method, self.remote = settings, method, remote
        self._pending_loads: dict[str, LoadSpec] = {}
        self._pending_saves: list[SaveSpec] = []
        self._unsaved_keys: set[str] = set()  # a producer is running or its save is unconfirmed
        self._failed_loads: set[str] = set()  # async loads that failed: vLLM computes them itself
        self._bad_plans: set[str] = set()  # requests whose plan was refused (logged once each)
        self._vllm_prefills: dict[str, int] = {}  # unclaimed requests -> rows vLLM's prefix cache held
        self._waiting_since: dict[str, float] = {}  # requests held back for an unsaved source -> since when
        # Requests asked to decide (DecideSpec) -> the rows the worker will materialize (None: no
        # answer yet), and the decisions to send with the next step.
        self._decided: dict[str, int | None] = {}
        self._decide_asked: dict[str, float] = {}  # -> when it was asked; then the wait it cost
        self._to_decide: list[DecideSpec] = []
        self._claim_local: dict[str, int] = {}  # claimed request -> the local hit it was claimed above
        self._followed: dict[str, FollowedRequest] = {}
        self._saves_sent: set[str] = set()  # keys whose save went to the workers, not confirmed yet
        self._prompt_saved: dict[str, int] = {}  # unsaved keys whose first rows are saved (their prompt)
        self._registered: OrderedDict[str, None] = OrderedDict()  # save keys of requests seen, latest last
        self._reuse_shares: dict[str, float] = {}  # agent -> its last finished turn's reused share
        self._first_choice: dict[str, bool] = {}  # request -> whether it decides first (decides_first)

    def decides_first(self, plan: Plan, req_id: str | None = None) -> bool:
        """Whether the worker decides what this request reuses before it is claimed (synchronous
        loads only: an asynchronous load already runs in steps of its own), unless its agent's last
        turn reused most of what it could (ConnectorSettings.direct_claim_share): then the load
        decides, without the extra engine step. Chosen once per request."""
        if req_id is not None and req_id in self._first_choice:
            return self._first_choice[req_id]
        choice = (plan.claim == "method" and self.method.decides_before_claim and not self.settings.asynchronous
                  and self._reuse_shares.get(plan.agent, 0.0) < self.settings.direct_claim_share)
        if req_id is not None:
            self._first_choice[req_id] = choice
        return choice

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

    def _source_on_its_way(self, plan: Plan, req_id: str) -> bool:
        """A source sent just before this request has not reached the engine yet (for a while)."""
        if all(key in self._registered for key in plan.sources_in_flight):
            return False
        since = self._waiting_since.setdefault(req_id, time.perf_counter())
        return time.perf_counter() - since < IN_FLIGHT_GRACE_S

    def _unreadable(self, plan: Plan) -> set[str]:
        """The caches the request reads that are not saved yet (as far as it reads them)."""
        return {key for key in plan.waits_for & self._unsaved_keys
                if (rows := plan.rows_read_from(key)) is None or self._prompt_saved.get(key, 0) < rows}

    def _follow_prompt_save(self, request: Request, plan: Plan, claimed: bool) -> None:
        """Follow a request a concurrent turn may read, to save its prompt once computed."""
        if not plan.readable_after_prefill or not plan.saved_key or request.request_id in self._followed:
            return
        prompt = list(request.prompt_token_ids or [])[:request.num_prompt_tokens]
        # (`unclaimed`: vLLM prefilled it, so its rows are exact; the save records no figures)
        save = SaveSpec(request.request_id, plan.saved_key, prompt, [], None if claimed else (len(prompt), 0),
                        adapter=plan.adapter)
        self._followed[request.request_id] = FollowedRequest(request.num_prompt_tokens, prompt_save=save)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self.plan_of(request)
        if plan is None:
            return 0, False
        if not plan.claimed(self.method.loads_request):  # vLLM prefills it in its own batches; it is still saved when it finishes
            self._vllm_prefills[request.request_id] = num_computed_tokens
            self._follow_prompt_save(request, plan, claimed=False)
            return 0, False
        if request.request_id in self._failed_loads:  # asked again after a failed async load
            self._failed_loads.discard(request.request_id)
            return 0, False
        req_id = request.request_id
        num_target = request.num_prompt_tokens - 1
        if plan.sources_in_flight and self._source_on_its_way(plan, req_id):
            return None, False
        if unsaved := self._unreadable(plan):
            self._waiting_since.setdefault(req_id, time.perf_counter())
            if self.decides_first(plan, req_id) and req_id not in self._decided and unsaved <= self._saves_sent | {
                    save.key for save in self._pending_saves}:
                # Its last sources are saved in the next step's worker call (or were in an earlier
                # one): the worker decides right after them, in the same step.
                self._ask_decision(request, num_computed_tokens, plan)
            return None, False  # a source is still being produced: ask again next step
        if self.remote is not None and self.remote.holds_back(req_id, plan, self._registered):
            self._waiting_since.setdefault(req_id, time.perf_counter())
            return None, False  # a source from another instance is not in the shared tier yet
        stop = num_target
        if self.decides_first(plan, req_id):
            if req_id not in self._decided:  # ask the worker; the request waits one step
                self._ask_decision(request, num_computed_tokens, plan)
                return None, False
            decided = self._decided[req_id]
            if decided is None:
                return None, False  # the decision is in this step's worker output
            stop = min(decided, num_target)
            asked = self._decide_asked.get(req_id)
            if asked is not None and asked > 0:  # the first claim after the answer: how long it took
                self._decide_asked[req_id] = -(time.perf_counter() - asked)
        self._claim_local[req_id] = num_computed_tokens
        count = max(0, stop - num_computed_tokens)
        self._follow_prompt_save(request, plan, claimed=count > 0)
        self._followed.setdefault(req_id, FollowedRequest(request.num_prompt_tokens))
        if count == 0:  # the method reuses nothing before vLLM's own rows: vLLM prefills it all
            self._vllm_prefills[req_id] = num_computed_tokens
        return count, count > 0 and self.settings.asynchronous

    def _ask_decision(self, request: Request, num_computed_tokens: int, plan: Plan) -> None:
        req_id = request.request_id
        self._decided[req_id] = None
        self._decide_asked[req_id] = time.perf_counter()
        self._to_decide.append(DecideSpec(req_id, list(request.prompt_token_ids or [])[:request.num_prompt_tokens - 1],
                                          num_computed_tokens, plan))

    def on_new_request(self, request: Request) -> None:
        plan = self.plan_of(request)
        if plan is not None and plan.saved_key:
            self._unsaved_keys.add(plan.saved_key)  # consumers arriving now must wait for it
            self._registered[plan.saved_key] = None
            while len(self._registered) > MAX_REGISTERED_KEYS:
                self._registered.popitem(last=False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        plan = self.plan_of(request)
        assert plan is not None, "only requests with a plan claim tokens"
        num_local = self._claim_local.get(request.request_id, request.num_prompt_tokens - 1 - num_external_tokens)
        since = self._waiting_since.pop(request.request_id, None)
        self._pending_loads[request.request_id] = LoadSpec(
            req_id=request.request_id, token_ids=list(request.prompt_token_ids or []),
            block_ids=list(blocks.get_block_ids()[0]), num_local=num_local,
            num_target=num_local + num_external_tokens, plan=plan,
            source_wait_s=0.0 if since is None else time.perf_counter() - since,
            decide_wait_s=self._decide_wait(request.request_id))

    def _decide_wait(self, req_id: str) -> float | None:
        asked = self._decide_asked.get(req_id)
        return -asked if asked is not None and asked <= 0 else None

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
        self._saves_sent |= {save.key for save in meta.saves if save.keep}
        meta.decides, self._to_decide = self._to_decide, []
        self._follow(scheduler_output, meta)
        return meta

    def _follow(self, scheduler_output: SchedulerOutput, meta: KVBenchMetadata) -> None:
        """Track the followed requests' blocks and mark those whose prompt this step finishes
        (with all their blocks); note whether the step computes any prompt tokens."""
        scheduled = scheduler_output.num_scheduled_tokens
        meta.prefilling = bool(scheduler_output.scheduled_new_reqs)
        for new in scheduler_output.scheduled_new_reqs:
            followed = self._followed.get(new.req_id)
            if followed is not None:
                followed.block_ids = list(new.block_ids[0])
                self._check_prefilled(new.req_id, followed, new.num_computed_tokens, scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            count = scheduled.get(req_id, 0)
            followed = self._followed.get(req_id)
            if followed is None:
                meta.prefilling |= count > 1  # a decode step computes one token per request
                continue
            new_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:  # resumed after a preemption: its whole block list
                followed.block_ids = list(new_ids[0]) if new_ids is not None else []
                followed.prefilled = False  # its prompt is computed again
            elif new_ids is not None:
                followed.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[index]
            meta.prefilling |= computed < followed.num_prompt_tokens
            self._check_prefilled(req_id, followed, computed, count, meta)

    @staticmethod
    def _check_prefilled(req_id: str, followed: FollowedRequest, computed: int, count: int,
                         meta: KVBenchMetadata) -> None:
        if not followed.prefilled and computed < followed.num_prompt_tokens <= computed + count:
            followed.prefilled = True
            meta.prefilled[req_id] = list(followed.block_ids)
            if followed.prompt_save is not None:
                followed.prompt_save.block_ids = list(followed.block_ids)
                meta.prompt_saves.append(followed.prompt_save)
                followed.prompt_save = None  # once: a preempted request's prompt is the same

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KVBenchWorkerMetadata):
            self._unsaved_keys -= worker_meta.saved_keys
            self._saves_sent -= worker_meta.saved_keys
            for key in worker_meta.saved_keys:
                self._prompt_saved.pop(key, None)
            for key, rows in worker_meta.prompt_saved.items():
                if key in self._unsaved_keys:  # (not when its whole save came first)
                    self._prompt_saved[key] = rows
            self._reuse_shares.update(worker_meta.reuse_shares)
            for req_id, stop in worker_meta.claims.items():
                if req_id in self._decided:  # (not when the request ended meanwhile)
                    self._decided[req_id] = stop
        self._failed_loads |= set(getattr(connector_output, "failed_recving", None) or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._failed_loads.discard(request.request_id)
        self._waiting_since.pop(request.request_id, None)
        if self.remote is not None:
            self.remote.forget(request.request_id)
        self._decided.pop(request.request_id, None)
        self._first_choice.pop(request.request_id, None)
        decide_wait = self._decide_wait(request.request_id)
        self._decide_asked.pop(request.request_id, None)
        self._claim_local.pop(request.request_id, None)
        self._followed.pop(request.request_id, None)
        prefix_cached = self._vllm_prefills.pop(request.request_id, None)
        plan = self.plan_of(request)
        self._bad_plans.discard(request.request_id)
        if plan is None or not plan.save_as:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED or request.num_computed_tokens == 0:
            self._unsaved_keys.discard(plan.save_as)  # never saved; do not block consumers
            self._prompt_saved.pop(plan.save_as, None)
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
            self._pending_saves.append(SaveSpec(request.request_id, plan.save_as, [], [], unclaimed, keep=False,
                                                decide_wait_s=decide_wait))
            return True, None
        self._pending_saves.append(SaveSpec(request.request_id, plan.save_as, tokens, list(block_ids), unclaimed,
                                            adapter=plan.adapter, decide_wait_s=decide_wait if unclaimed else None))
        return True, {PLAN_KEY: {"save_as": plan.save_as, "num_tokens": len(tokens)}}
