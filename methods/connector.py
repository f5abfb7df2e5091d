"""KVBenchConnector: the one vLLM V1 KV connector through which every sharing method runs.

Scheduler side (engine process): for a request with a kvbench plan, claim every prompt token but
the last as a synchronous external hit, so the worker loads them before the forward; wait (return
None) while a source cache is still being produced; hold finished requests' blocks until the
worker has copied them into the segment store.

Worker side (each worker process): before the forward, materialize K/V for every claimed row:
rows the method reuses come from the source cache, keys re-rotated to the new positions, plus the
method's correction; every other row is computed by a partial forward over the model's own
modules. Any internal error reports the request's blocks as failed, and vLLM (load failure policy
"recompute") recomputes them itself: a dense fallback that never returns wrong K/V.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvbench.methods.base import LoadContext, MethodConfigError, SegmentReuse, SharingMethod
from kvbench.methods.compute_tracker import ComputedRequests
from kvbench.methods.forward import LayerGroup
from kvbench.methods.plan import Plan, parse_plan
from kvbench.methods.store import SavedKV, SegmentStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvbench.connector")

DEFAULT_MAX_STORE_BYTES = 4 << 30
MAX_KEPT_REQUEST_STATS = 100_000
MAX_PENDING_HIDDEN = 256


def fault_fraction(mode: Any) -> float | None:
    """The share of loads a `fault_injection` fraction fails (None: not a fraction)."""
    try:
        fraction = float(mode)
    except (TypeError, ValueError):
        return None
    return fraction if 0 < fraction <= 1 else None


def fault_hash(key: str) -> float:
    """A request key's place in [0, 1): which loads a fault fraction fails, alike on every rank."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def load_method(name: str, params: dict[str, Any]) -> SharingMethod:
    from kvbench.methods.registry import method_class

    try:
        return method_class(name)(params)
    except ValueError as exc:  # unknown name, or a method that runs without the connector
        raise MethodConfigError(str(exc)) from None


@dataclass
class ConnectorSettings:
    method: str
    params: dict[str, Any]
    max_store_bytes: int
    # Tests of the dense fallback: "all" raises inside every load, a fraction (e.g. "0.25") inside
    # that share of the loads (picked by a hash of the request's key: the same on every
    # tensor-parallel rank, and from run to run), "flagged" inside loads whose plan has inject_fault; "flagged_nonfinite_rank0" makes such loads place a non-finite value
    # on tensor-parallel rank 0 only (every rank must still fall back together).
    fault_injection: str | None
    # 0: a request's cache is materialized in the engine step that schedules it (vLLM's sync
    # load). N > 0: loads are asynchronous and each engine step runs partial-forward layers of the
    # waiting loads, the one with the least work left first, until about N tokens' worth of rows
    # went through all layers (at least one layer per step), so one long load cannot stall the
    # batch for long, nor hold up the short loads queued behind it.
    max_load_tokens_per_step: int = 0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> "ConnectorSettings":
        known = {"method", "params", "max_store_bytes", "fault_injection", "max_load_tokens_per_step"}
        if unknown := set(extra) - known:
            raise MethodConfigError(f"unknown kv_connector_extra_config key(s): {', '.join(sorted(unknown))}")
        if "method" not in extra:
            raise MethodConfigError("kv_connector_extra_config needs 'method'")
        max_bytes = int(extra.get("max_store_bytes", DEFAULT_MAX_STORE_BYTES))
        if max_bytes <= 0:
            raise MethodConfigError(f"max_store_bytes must be > 0, got {max_bytes}")
        fault = extra.get("fault_injection")
        if fault not in (None, "all", "flagged", "flagged_nonfinite_rank0") and fault_fraction(fault) is None:
            raise MethodConfigError(f"fault_injection must be 'all', a fraction in (0, 1] of the loads, 'flagged', "
                                    f"'flagged_nonfinite_rank0' or absent, got {fault!r}")
        budget = extra.get("max_load_tokens_per_step", 0)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise MethodConfigError(f"max_load_tokens_per_step must be an integer >= 0, got {budget!r}")
        return cls(str(extra["method"]), dict(extra.get("params") or {}), max_bytes, fault, budget)


@dataclass
class LoadSpec:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_local: int  # rows already valid (vLLM prefix-cache hit)
    num_target: int  # rows valid after the load: prompt length - 1
    plan: Plan


@dataclass
class SaveSpec:
    req_id: str
    key: str
    token_ids: list[int]
    block_ids: list[int]


def planned_rows(spec: LoadSpec) -> int:
    """Rows per layer a load computes by its plan: every claimed row but those of the shared
    segments it names a source for. A method may compute more (a rejected correction, rows it
    recomputes); the load's first layer tells."""
    sourced = sum(max(0, min(s.start + s.length, spec.num_target) - max(s.start, spec.num_local))
                  for s in spec.plan.segments if s.kind == "ph" and s.source)
    return max(1, spec.num_target - spec.num_local - sourced)


@dataclass(eq=False)  # a job is itself: the queue removes it by identity
class LoadJob:
    """A load in progress on the worker: its spec and the generator doing its work."""

    spec: LoadSpec
    work: Generator[int, None, dict[str, Any]]
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0  # engine steps it ran in
    # per step it ran in: how many other requests that engine step computed (running decodes and
    # prefills); shows whether they advanced while this load was in progress
    step_batches: list[int] = field(default_factory=list)
    # per step it ran in: seconds from its creation to that step's share of its work (the first
    # shows how long it queued behind other loads, the gaps how long it waited between steps)
    step_offsets_s: list[float] = field(default_factory=list)
    layers_done: int = 0
    last_rows: int | None = None  # rows its last finished layer computed

    @property
    def key(self) -> str:
        return self.spec.plan.save_as or self.spec.req_id

    def rows_left(self, layers: int) -> int:
        """Rows it still has to put through a layer: the rows of its last layer (its plan's before
        the first) times the layers left."""
        per_layer = planned_rows(self.spec) if self.last_rows is None else self.last_rows
        return max(1, per_layer) * max(1, layers - self.layers_done)


def next_load(queue: Iterable[LoadJob], layers: int) -> LoadJob:
    """The waiting load with the fewest rows left (the oldest of equals). A load that reuses most
    of its rows then ends in the next step rather than after every layer of a dense prefill queued
    before it: shortest remaining work first, which minimizes the mean wait."""
    return min(queue, key=lambda job: job.rows_left(layers))


@dataclass
class KVBenchMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    scheduled_req_ids: frozenset[str] = frozenset()  # the requests this engine step computes


@dataclass
class KVBenchWorkerMetadata(KVConnectorWorkerMetadata):
    saved_keys: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVBenchWorkerMetadata":
        assert isinstance(other, KVBenchWorkerMetadata)
        # Tensor-parallel ranks save their own heads under the same key.
        return KVBenchWorkerMetadata(self.saved_keys | other.saved_keys)


class KVBenchConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config or {})
        self.method = load_method(self.settings.method, self.settings.params)  # validates the parameters
        self.block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._pending_loads: dict[str, LoadSpec] = {}
        self._pending_saves: list[SaveSpec] = []
        self._unsaved_keys: set[str] = set()  # a producer is running or its save is unconfirmed
        self._failed_loads: set[str] = set()  # async loads that failed: vLLM computes them itself
        # worker side
        self.store = SegmentStore(self.settings.max_store_bytes)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, Any] = {}
        self.forward: Any = None
        self.aligner: Any = None
        self.request_stats: dict[str, dict[str, Any]] = {}
        self._saved_this_step: set[str] = set()
        self._finished_sending: set[str] = set()
        # asynchronous loads (max_load_tokens_per_step > 0): a few layers per step, least work left first
        self._load_queue: deque[LoadJob] = deque()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._computed = ComputedRequests()  # what deferred method work waits for
        self._saves_done_for: KVConnectorMetadata | None = None
        # save key -> (rows, their residual stream [rows, hidden], layer) captured at the load,
        # attached to the cache when the request finishes (methods with recompute_layers only)
        self._hidden_for_save: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        logger.info("kvbench connector (%s) for method %s, params %s", role.name, self.settings.method,
                    self.method.params)

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = parse_plan(request.kv_transfer_params)
        if plan is None or not plan.claim:
            return 0, False
        if request.request_id in self._failed_loads:  # asked again after a failed async load
            self._failed_loads.discard(request.request_id)
            return 0, False
        if plan.sources & self._unsaved_keys:
            return None, False  # a source is still being produced: ask again next step
        count = max(0, request.num_prompt_tokens - 1 - num_computed_tokens)
        return count, count > 0 and self.settings.max_load_tokens_per_step > 0

    def on_new_request(self, request: "Request") -> None:
        plan = parse_plan(request.kv_transfer_params)
        if plan is not None and plan.save_as:
            self._unsaved_keys.add(plan.save_as)  # consumers arriving now must wait for it

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        plan = parse_plan(request.kv_transfer_params)
        assert plan is not None
        num_target = request.num_prompt_tokens - 1
        self._pending_loads[request.request_id] = LoadSpec(
            req_id=request.request_id, token_ids=list(request.prompt_token_ids or []),
            block_ids=list(blocks.get_block_ids()[0]), num_local=num_target - num_external_tokens,
            num_target=num_target, plan=plan)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
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
        if self.settings.max_load_tokens_per_step > 0:  # async: the requests wait unscheduled
            meta.loads.extend(self._pending_loads.values())
        self._pending_loads.clear()
        meta.saves, self._pending_saves = self._pending_saves, []
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KVBenchWorkerMetadata):
            self._unsaved_keys -= worker_meta.saved_keys
        self._failed_loads |= set(getattr(connector_output, "failed_recving", None) or ())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._failed_loads.discard(request.request_id)
        plan = parse_plan(request.kv_transfer_params)
        if plan is None or not plan.save_as:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED or request.num_computed_tokens == 0:
            self._unsaved_keys.discard(plan.save_as)  # never saved; do not block consumers
            return False, None
        # K/V exists for every computed token: the prompt and all generated tokens but the last.
        tokens = list(request.all_token_ids[: request.num_computed_tokens])
        self._pending_saves.append(SaveSpec(request.request_id, plan.save_as, tokens, list(block_ids)))
        return True, {"kvbench": {"save_as": plan.save_as, "num_tokens": len(tokens)}}

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvbench.methods.paged import layout_for

        self.kv_caches = kv_caches
        forward_context = self._vllm_config.compilation_config.static_forward_context
        by_kind: dict[tuple, Any] = {}
        for name, cache in kv_caches.items():
            isa = getattr(forward_context[name], "isa", None)
            kind = (cache.device.type, isa, tuple(cache.shape[1:]), cache.dtype)
            if kind not in by_kind:
                by_kind[kind] = layout_for(cache, isa)
            self.layouts[name] = by_kind[kind]

    def attach_model(self, model: torch.nn.Module) -> None:
        """Called once per worker (kvbench's worker extension, over collective_rpc)."""
        from kvbench.methods.forward import PartialForward
        from kvbench.methods.rope import RopeAligner

        inner = model.model
        layers = list(inner.layers)[inner.start_layer:inner.end_layer]
        names = [layer.self_attn.attn.layer_name for layer in layers]
        self.forward = PartialForward(model, names, self.layouts, self.kv_caches)
        self.aligner = RopeAligner(self.forward.rotary_emb)
        self.method.bind(self)
        self._check_method_fits(self.method)
        logger.info("kvbench connector: model attached (%d layers)", len(layers))

    @property
    def num_layers(self) -> int:
        assert self.forward is not None, "model not attached"
        return len(self.forward.layers)

    def computed(self, req_id: str) -> bool:
        return self._computed.computed(req_id)

    @property
    def tensor_parallel_size(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()

    def _tensor_parallel_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() if self.tensor_parallel_size > 1 else 0

    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        if self.tensor_parallel_size == 1:
            return partial
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(partial.contiguous())

    def _check_method_fits(self, method: SharingMethod) -> None:
        """Selective recomputation narrows after its check layer, so that layer needs one after it;
        a recomputed layer group must lie inside the model."""
        assert self.forward is not None
        layers, check = len(self.forward.layers), method.check_layer()
        if check is not None and not 0 <= check < layers - 1:
            raise MethodConfigError(f"{method.name}: check_layer must be in [0, {layers - 2}] for this "
                                    f"{layers}-layer model, got {check}")
        group = method.recompute_layers()
        if group is not None and not 0 <= group[0] < group[1] <= layers:
            raise MethodConfigError(f"{method.name}: recomputed layers [{group[0]}, {group[1]}) must be a non-empty "
                                    f"range inside this {layers}-layer model's [0, {layers})")
        if group is not None and check is not None and not group[0] <= check < group[1] - 1:
            raise MethodConfigError(f"{method.name}: the check layer ({check}) must lie in the recomputed layers "
                                    f"[{group[0]}, {group[1]}) with a layer of them after it")

    def _influence(self, layer: int, q: torch.Tensor, q_rows: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Attention mass each row of the request receives at `layer` from the query rows `q_rows`
        (summed over them and the heads), over the K/V now in the paged cache."""
        from kvbench.methods.influence import attention_mass

        name = self.forward.layer_names[layer]
        keys, _ = self.layouts[name].read(self.kv_caches[name], block_ids, int(q_rows.max()) + 1)
        scale = self.forward.layers[layer].self_attn.attn.impl.scale
        return self.sum_over_ranks(attention_mass(q, q_rows, keys, scale)).cpu()  # over all heads

    def _hidden_layer(self) -> int | None:
        """The layer whose entering residual stream the method recomputes from (None: none kept)."""
        group = self.method.recompute_layers()
        return group[0] if group is not None and group[0] > 0 else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBenchMetadata)
        self._do_saves(meta)  # first: a load in this same step may read a source saved now
        self._computed.step(meta.scheduled_req_ids)
        try:
            self.method.run_deferred()
        except Exception:  # noqa: BLE001 - method state updates must never take the engine down
            logger.exception("kvbench: deferred work of %s failed", self.method.name)
        if self.settings.max_load_tokens_per_step > 0:
            self._load_queue.extend(LoadJob(spec, self._materialize_steps(spec)) for spec in meta.loads)
            self._advance_loads(meta.scheduled_req_ids)
            return
        for spec in meta.loads:  # synchronous: each load ends in this step, before the forward
            job = LoadJob(spec, self._materialize_steps(spec))
            stats, _ = self._run_load(job, None, meta.scheduled_req_ids)
            assert stats is not None
            self._finish_load(job, stats)

    def _run_load(self, job: "LoadJob", budget: int | None,
                  scheduled: frozenset[str]) -> tuple[dict[str, Any] | None, int]:
        """Run a load's layers until it ends or `budget` rows were computed (None: to the end), in
        an engine step that computes the requests `scheduled`. Returns (its stats when it ended,
        else None; rows computed)."""
        spent = 0
        job.steps += 1
        job.step_batches.append(len(scheduled - {job.spec.req_id}))
        job.step_offsets_s.append(time.perf_counter() - job.started)
        try:
            while True:
                rows = next(job.work)
                job.layers_done, job.last_rows = job.layers_done + 1, rows
                spent += rows
                if budget is not None and spent >= budget:
                    return None, spent
        except StopIteration as done:
            return done.value, spent
        except Exception as exc:  # noqa: BLE001 - any failure falls back to vLLM's own prefill
            logger.exception("kvbench: load of %s failed; vLLM recomputes it densely", job.key)
            spec = job.spec
            if self.settings.max_load_tokens_per_step > 0:
                self._failed_recving.add(spec.req_id)  # vLLM recomputes the whole request
            else:
                self._failed_blocks.update(spec.block_ids[spec.num_local // self.block_size:])
            return {"fallback": "dense", "error": f"{type(exc).__name__}: {exc}",
                    "reused_tokens": 0, "recomputed_tokens": spec.num_target - spec.num_local}, spent

    def _advance_loads(self, scheduled: frozenset[str]) -> None:
        """One engine step's share of the asynchronous loads: layers of the waiting load with the
        least work left (then the next) until max_load_tokens_per_step tokens' worth of rows went
        through every layer; at least one layer."""
        spent = 0
        layers = len(self.forward.layers) if self.forward is not None else 1
        budget = self.settings.max_load_tokens_per_step * layers  # in rows through one layer
        while self._load_queue and (spent < budget or spent == 0):
            job = next_load(self._load_queue, layers)
            stats, rows = self._run_load(job, budget - spent, scheduled)
            spent += max(rows, 1)
            if stats is None:
                return
            self._load_queue.remove(job)
            self._finish_load(job, stats)
            self._finished_recving.add(job.spec.req_id)

    def _finish_load(self, job: "LoadJob", stats: dict[str, Any]) -> None:
        spec = job.spec
        stats["load_s"] = time.perf_counter() - job.started
        stats.update(turn=spec.plan.turn, agent=spec.plan.agent, local_tokens=spec.num_local,
                     claimed_tokens=spec.num_target - spec.num_local, load_steps=job.steps,
                     load_step_batches=job.step_batches, load_step_offsets_s=job.step_offsets_s)
        self._record_stats(job.key, stats)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # sync loads complete in start_load_kv, before the forward; async ones are not scheduled yet

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # finished requests are copied once, from their held blocks

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBenchMetadata)
        self._do_saves(meta)  # steps without loads (or without a forward) still save

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._computed.finished(finished_req_ids)
        done, self._finished_sending = self._finished_sending, set()
        loaded, self._finished_recving = self._finished_recving, set()
        return (done or None), (loaded or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        # a failed load also ends the request's wait (vLLM then recomputes it)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()) | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._saved_this_step:
            return None
        meta, self._saved_this_step = KVBenchWorkerMetadata(self._saved_this_step), set()
        return meta

    # ---------------------------------------------------------------- internals
    def _record_stats(self, key: str, stats: dict[str, Any]) -> None:
        self.request_stats[key] = stats
        while len(self.request_stats) > MAX_KEPT_REQUEST_STATS:
            self.request_stats.pop(next(iter(self.request_stats)))

    def _do_saves(self, meta: KVBenchMetadata) -> None:
        if self._saves_done_for is meta:
            return
        self._saves_done_for = meta
        for save in meta.saves:
            started = time.perf_counter()
            try:
                n = len(save.token_ids)
                block_ids = torch.tensor(save.block_ids, dtype=torch.long)
                names = self.forward_layer_names()
                keys = values = None
                for index, name in enumerate(names):  # copied into one [layers, n, Hkv, hd] tensor each
                    k, v = self.layouts[name].read(self.kv_caches[name], block_ids, n)
                    if keys is None:
                        keys = k.new_empty((len(names), *k.shape))
                        values = v.new_empty((len(names), *v.shape))
                    keys[index].copy_(k)
                    values[index].copy_(v)
                assert keys is not None and values is not None
                entry = SavedKV(torch.tensor(save.token_ids, dtype=torch.long), keys, values)
                if (captured := self._hidden_for_save.pop(save.key, None)) is not None:
                    rows, stream, layer = captured  # rows vLLM computed (generated tokens) have none
                    entry.hidden = stream.new_zeros((n, stream.shape[1]))
                    entry.hidden_valid = torch.zeros(n, dtype=torch.bool)
                    entry.hidden[rows.to(stream.device)], entry.hidden_valid[rows] = stream, True
                    entry.hidden_layer = layer
                self.store.put(save.key, entry)
                self.request_stats.setdefault(save.key, {})["save_s"] = time.perf_counter() - started
            except Exception:  # noqa: BLE001 - a failed save only means later consumers compute
                logger.exception("kvbench: saving %s failed", save.key)
            self._saved_this_step.add(save.key)  # confirmed either way, so consumers never hang
            self._finished_sending.add(save.req_id)

    def forward_layer_names(self) -> list[str]:
        if self.forward is not None:
            return self.forward.layer_names
        return list(self.kv_caches)

    def _candidates(self, spec: LoadSpec, tokens: torch.Tensor) -> tuple[list[SegmentReuse], int, int]:
        """PH rows a saved source holds with identical tokens; also counts PH rows without one,
        and among them the rows whose plan named a source the store no longer holds."""
        candidates, missing, evicted = [], 0, 0
        for segment in spec.plan.segments:
            if segment.kind != "ph":
                continue
            start = max(segment.start, spec.num_local)
            stop = min(segment.start + segment.length, spec.num_target)
            if stop <= start:
                continue
            source = self.store.get(segment.source) if segment.source else None
            if source is None or segment.source_start is None:
                missing += stop - start
                if segment.source and source is None:  # the store's cap dropped (or refused) it
                    evicted += stop - start
                continue
            dst = torch.arange(start, stop)
            src = dst - segment.start + segment.source_start
            inside = src < source.num_tokens  # the producer's last token never got K/V
            dst, src = dst[inside], src[inside]
            same = source.token_ids[src] == tokens[dst]  # never reuse rows of other tokens
            missing += (stop - start) - int(same.sum())
            if bool(same.any()):
                candidates.append(SegmentReuse(segment, source, dst[same], src[same]))
        return candidates, missing, evicted

    @torch.inference_mode()
    def _materialize_steps(self, spec: LoadSpec) -> Generator[int, None, dict[str, Any]]:
        """A request's load, one partial-forward layer at a time (yields the rows each computed)."""
        fault = self.settings.fault_injection
        fraction = fault_fraction(fault)
        if (fault == "all" or (fault == "flagged" and spec.plan.inject_fault)
                or (fraction is not None and fault_hash(spec.plan.save_as or spec.req_id) < fraction)):
            raise RuntimeError("injected fault (kv_connector_extra_config.fault_injection)")
        if self.forward is None:
            raise RuntimeError("model not attached: call the worker extension's kvbench_attach_model "
                               "(kvbench serve/replay do this after start-up)")
        n = spec.num_target
        tokens = torch.tensor(spec.token_ids[:n], dtype=torch.long)
        block_ids = torch.tensor(spec.block_ids, dtype=torch.long)
        positions = torch.arange(n, dtype=torch.long)
        slots = block_ids[positions // self.block_size] * self.block_size + positions % self.block_size
        candidates, missing, evicted = self._candidates(spec, tokens)
        poison = fault == "flagged_nonfinite_rank0" and spec.plan.inject_fault and self._tensor_parallel_rank() == 0

        def read_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            n_read = int(rows.max()) + 1 if len(rows) else 0
            ks, vs = [], []
            for name in self.forward.layer_names:
                k, v = self.layouts[name].read(self.kv_caches[name], block_ids, n_read)
                ks.append(k.index_select(0, rows))
                vs.append(v.index_select(0, rows))
            return torch.stack(ks), torch.stack(vs)

        ctx = LoadContext(spec.plan.save_as or spec.req_id, spec.plan, tokens, spec.num_local, candidates, read_rows,
                          req_id=spec.req_id)
        yield from self.method.prepare(ctx)  # e.g. reference prefills: spread over steps like the layers below
        chosen = self.method.select(ctx)
        reused = torch.zeros(n, dtype=torch.bool)
        for reuse in chosen:
            reused[reuse.dst] = True
        reused[: spec.num_local] = False
        compute = (~reused).nonzero().flatten()
        compute = compute[compute >= spec.num_local]
        rows = torch.cat([r.dst for r in chosen]) if chosen else torch.empty(0, dtype=torch.long)
        check = self.method.check_layer() if chosen else None
        group_layers = self.method.recompute_layers() if chosen else None
        group = None
        if group_layers is not None:  # reused rows are computed in these layers, from their source's stream
            start, stop = group_layers
            entering = torch.cat([r.source.hidden[r.src.to(r.source.hidden.device)] for r in chosen]) if start else None  # type: ignore[index]
            group = LayerGroup(rows, entering, start, stop)
        capture = self._hidden_layer() if spec.plan.save_as else None
        placed_at_check: list[tuple[torch.Tensor, torch.Tensor]] = []
        picked: list[int] = []
        if check is not None and group is None:  # CacheBlend: every row is computed up to the check layer
            compute = torch.arange(spec.num_local, n)

        def all_computed(layer: int) -> bool:
            """Every reused row is computed in this layer (so none is placed)."""
            if group_layers is None:
                return check is not None and layer < check
            start, stop = group_layers
            return start <= layer < (check if check is not None else stop)

        def placed_rows(layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if not chosen or all_computed(layer):
                return rows[:0], torch.empty(0), torch.empty(0)
            ks, vs = [], []
            for reuse in chosen:
                src = reuse.src.to(reuse.source.k.device)  # plans index on the CPU; the cache may be on a GPU
                k = self.aligner.rotate(reuse.source.k[layer].index_select(0, src), reuse.dst - reuse.src)
                v = reuse.source.v[layer].index_select(0, src)
                k, v = self.method.correct(layer, reuse, k, v)
                ks.append(k)
                vs.append(v)
            k_all, v_all = torch.cat(ks), torch.cat(vs)
            if poison:
                k_all.view(-1)[0] = float("nan")
            # Summed over tensor-parallel ranks (each holds other heads), so that all of them raise
            # together: a rank falling back alone would leave the others waiting in a collective.
            bad = (~torch.isfinite(k_all)).sum() + (~torch.isfinite(v_all)).sum()
            if float(self.sum_over_ranks(bad.float().reshape(1))) > 0:
                raise FloatingPointError(f"non-finite K/V from method {self.method.name} at layer {layer}")
            if layer == check:  # written, then overwritten by the fresh rows: kept for the comparison
                placed_at_check.append((k_all, v_all))
            return rows, k_all, v_all

        def narrow(layer: int, computed: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor | None:
            """At the check layer: keep computing the rows no source held and the reused rows the
            method picks from their fresh vs reused K/V (and the attention they get)."""
            if layer != check:
                return None
            k_reused, v_reused = placed_at_check.pop()
            past_local = rows >= spec.num_local  # rows vLLM's prefix cache held are not computed
            position = torch.searchsorted(computed, rows[past_local])  # computed rows are in position order
            influence = None
            if (queries := self.method.influence_queries()) > 0:
                influence = self._influence(layer, q[-queries:], computed[-queries:], block_ids)[rows[past_local]]
            chosen_rows = self.method.recompute(ctx, layer, k[position], v[position], k_reused[past_local],
                                                v_reused[past_local], influence).cpu()  # row indices live on the CPU
            keep = ~reused[computed]
            keep[position[chosen_rows]] = True
            picked.append(int(chosen_rows.sum()))
            return keep.nonzero().flatten()

        started = time.perf_counter()
        forward = yield from self.forward.steps(tokens, block_ids, slots, compute, placed_rows,
                                                narrow if check is not None else None, group, capture)
        if capture is not None and forward.captured is not None:
            self._hidden_for_save[str(spec.plan.save_as)] = (*forward.captured, capture)
            while len(self._hidden_for_save) > MAX_PENDING_HIDDEN:  # requests aborted before their save
                self._hidden_for_save.pop(next(iter(self._hidden_for_save)))
        # Selective recomputation: reused rows count as reused when served from reuse after the
        # check layer; the recomputed ones count as recomputed. A recomputed layer group: reused
        # rows count in whole-token units of the (token, layer) entries served from reuse.
        reused_count, n_picked = int(reused.sum()), (picked[0] if picked else 0)
        if group_layers is None:
            recomputed = (int((~reused[compute]).sum()) + n_picked) if check is not None else int(len(compute))
            reused_count -= n_picked
        else:
            layers, (start, stop) = self.num_layers, group_layers
            all_width = (check + 1 - start) if check is not None else (stop - start)  # layers every reused row computes
            served = round((reused_count * (layers - all_width) - n_picked * ((stop - start) - all_width)) / layers)
            recomputed = int(len(compute)) + reused_count - served
            reused_count = served
        stats: dict[str, Any] = {
            "method": self.method.name,
            "reused_tokens": reused_count,
            "recomputed_tokens": recomputed,
            "ph_without_source_tokens": missing,
            "source_missing_tokens": evicted,  # rows whose named source the store no longer held
            "eligible_tokens": ctx.stats.pop("eligible_tokens", sum(len(c.dst) for c in candidates)),
            "materialize_s": time.perf_counter() - started,
            "attention_s": forward.attention_s,
            "segments": [{"id": r.segment.id, "source": r.segment.source, "reused": int(len(r.dst))} for r in chosen],
            **ctx.stats,
        }
        ctx.stats = stats
        self._computed.loaded(spec.req_id)
        self.method.after_load(ctx)
        return stats

    # ---------------------------------------------------------------- introspection (worker extension)
    def stats_snapshot(self, clear: bool) -> dict[str, Any]:
        method_bytes = self.method.state_bytes()
        out = {
            "method": self.method.name,
            "params": self.method.params,
            "requests": dict(self.request_stats),
            "store_bytes": self.store.bytes,
            "store_peak_bytes": self.store.peak_bytes,
            "store_entries": len(self.store.entries),
            "store_evictions": self.store.evictions,
            "store_refused": self.store.refused,
            "method_state_bytes": method_bytes,
            "model_attached": self.forward is not None,
        }
        if clear:
            self.request_stats.clear()
        return out

    def context_free_prefill_steps(self, tokens: torch.Tensor) -> Generator[int, None, SavedKV]:
        k, v = yield from self.forward.context_free_steps(tokens)
        return SavedKV(tokens.clone(), k, v)

    def kv_error(self, key: str, reference: str, start: int = 0, stop: int | None = None) -> dict[str, Any]:
        """Normalized error ||C - C_ref||_F / ||C_ref||_F per layer over rows [start, stop)."""
        entry, ref = self.store.get(key), self.store.get(reference)
        if entry is None or ref is None:
            raise KeyError(f"not in the segment store: {key if entry is None else reference}")
        n = min(entry.num_tokens, ref.num_tokens, stop if stop is not None else 1 << 62)
        layers = []
        rows = slice(start, n)
        for layer in range(entry.k.shape[0]):
            row = {}
            for name, a, b in (("k", entry.k[layer, rows], ref.k[layer, rows]),
                               ("v", entry.v[layer, rows], ref.v[layer, rows])):
                reference = b.float()
                diff = a.float() - reference
                # this rank's share of the squared norms (tensor-parallel ranks' shards add up), and
                # the relative error they give
                sq_err, sq_ref = float(diff.square().sum()), float(reference.square().sum())
                row[f"{name}_sq_err"], row[f"{name}_sq_ref"] = sq_err, sq_ref
                row[f"{name}_rel"] = math.sqrt(sq_err) / max(math.sqrt(sq_ref), 1e-30)
                row[f"{name}_max_abs"] = float(diff.abs().max())
            layers.append(row)
        identical = bool(torch.equal(entry.k[:, rows], ref.k[:, rows]) and torch.equal(entry.v[:, rows], ref.v[:, rows]))
        return {"rows": n - start, "layers": layers, "bit_identical": identical,
                "same_tokens": bool(torch.equal(entry.token_ids[rows], ref.token_ids[rows]))}

    def saved_rows(self, key: str, layer: int, start: int, stop: int) -> dict[str, Any]:
        entry = self.store.get(key)
        if entry is None:
            raise KeyError(f"not in the segment store: {key}")
        return {"k": entry.k[layer, start:stop].float().tolist(), "v": entry.v[layer, start:stop].float().tolist()}

    def set_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Replace the method (same name, new parameters, empty state): e.g. to tune tau on one server."""
        method = load_method(self.settings.method, {**self.method.params, **params})
        if self.forward is not None:
            method.bind(self)  # first: a method may size itself by the model (DroidSpeak's default group)
            self._check_method_fits(method)
        self.method = method
        self.settings.params = dict(method.params)
        return dict(method.params)

    def reset_state(self, keep_method_state: bool = False) -> None:
        """Drop saved caches and per-request stats; also the method's learned state unless kept
        (warm-ups that prime anchor pools before a measured run)."""
        self.store.clear()
        self._hidden_for_save.clear()
        if keep_method_state:
            self.method.restart_peaks()
        else:
            self.method.reset()
        self.request_stats.clear()
