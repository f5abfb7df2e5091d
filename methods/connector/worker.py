"""The connector's worker side (each worker process): the paged caches, the attached model, the
loads, the saves into the segment store, and what the worker RPCs ask of them. It is also the
`CoreServices` that methods see."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Generator
from typing import Any, cast

import torch

from kvbench.contracts import LoadStats, vllm_prefill_stats
from kvbench.methods.api.base import MethodConfigError, SharingMethod
from kvbench.methods.connector.compute_tracker import ComputedRequests
from kvbench.methods.connector.counters import ReuseCounters
from kvbench.methods.connector.deliveries import RowDeliveries, RowsDelivery
from kvbench.methods.connector.fits import check_method_fits
from kvbench.methods.connector.loads import LoadJob, make_loads
from kvbench.methods.connector.materialize import LoadDecision, decide_steps, materialize_steps, prompt_rows
from kvbench.methods.connector.metadata import KVBenchMetadata, KVBenchWorkerMetadata
from kvbench.methods.connector.saves import Hidden, saved_copy
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.connector.specs import DecideSpec, SaveSpec
from kvbench.methods.core.entry_bytes import EntryShape
from kvbench.methods.core.forward import run_to_end
from kvbench.methods.core.kv_codec import params_codec
from kvbench.methods.core.lora import VLora, served_adapters
from kvbench.methods.core.store import SavedKV
from kvbench.methods.core.tiered_store import segment_store

logger = logging.getLogger("kvbench.connector")

MAX_KEPT_REQUEST_STATS = 100_000
MAX_PENDING_HIDDEN = 256  # residual streams kept for saves; more means requests aborted before theirs
# Steps the method's deferred work may wait for one that computes no prompt tokens (then it runs
# anyway: under a steady stream of prefills every step has one).
MAX_DEFERRED_WAIT_STEPS = 16



class ConnectorWorker:
    def __init__(self, settings: ConnectorSettings, method: SharingMethod, block_size: int,
                 static_forward_context: dict[str, Any], model_path: str = "") -> None:
        self.settings, self.method, self.block_size = settings, method, block_size
        # What the scheduler side (another object, maybe another process) read at start-up and keeps.
        self._scheduler_loads_every_request = method.loads_every_request()
        self.model_path = model_path  # what vLLM loaded: a directory or a hub name
        self._forward_context = static_forward_context  # layer name -> attention module
        self.store = segment_store(settings.max_store_bytes, params_codec(self.method.params), settings.shared_tier,
                                   model_path)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, Any] = {}
        self.forward: Any = None  # PartialForward, once the model is attached
        self.aligner: Any = None  # RopeAligner, likewise
        self.request_stats: dict[str, LoadStats] = {}
        self.computed_requests = ComputedRequests()  # what deferred method work waits for
        self.loads = make_loads(
            lambda spec: materialize_steps(self, spec, self._keep_hidden, self._decisions.pop(spec.req_id, None)),
            self._finish_load, block_size, settings.max_load_tokens_per_step)
        self._decisions: dict[str, LoadDecision] = {}  # decided ahead of their claim, for their load
        self._unclaimed_decisions: dict[str, LoadStats] = {}  # decided ahead, nothing claimed: by key, till the save
        self._claims: dict[str, int] = {}  # decided this step -> rows claimed (for the scheduler side)
        self.deliveries = RowDeliveries()  # rows methods asked for, once computed (when_prefilled)
        self._deferred_wait_steps = 0
        self._saved_this_step: set[str] = set()
        self._prompts_saved_this_step: dict[str, int] = {}  # key -> rows, saved ahead of the request's end
        self._reuse_shares: dict[str, float] = {}  # agent -> its last turn's reused share, to report
        self._prompt_save_s: dict[str, float] = {}  # -> the copy's time, for the request's stats at its save
        self._finished_sending: set[str] = set()
        self._saves_done_for: KVBenchMetadata | None = None
        # save key -> (rows, their residual stream [rows, hidden], layer) captured at the load,
        # attached to the cache when the request finishes (methods with recompute_layers only)
        self._hidden_for_save: dict[str, Hidden] = {}
        # save key -> the rows before its first reused row (exact, as a dense prefill), from its load
        self._exact_rows_for_save: dict[str, int] = {}
        self.deferred_s = 0.0  # the method's deferred work (anchor building, prematching) since the reset
        self.reuse_counters = ReuseCounters()  # totals for vLLM's connector-stats path (/metrics)
        self._adapters: dict[str, VLora] = {}  # the served V-only adapters, once the model is attached
        self._model: torch.nn.Module | None = None  # the model attached (once)

    # ---------------------------------------------------------------- set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvbench.methods.core.paged import layout_for

        self.kv_caches = kv_caches
        by_kind: dict[tuple, Any] = {}
        for name, cache in kv_caches.items():
            layer = self._forward_context[name]
            isa = getattr(layer, "isa", None)
            backend = getattr(layer, "attn_backend", None)
            backend_name = backend.get_name() if backend is not None and hasattr(backend, "get_name") else type(layer).__name__
            kind = (cache.device.type, isa, tuple(cache.shape[1:]), cache.dtype)
            if kind not in by_kind:
                by_kind[kind] = layout_for(cache, isa, backend_name)  # refused here, at start, if unsupported
            self.layouts[name] = by_kind[kind]
        first = next(iter(kv_caches))
        row_k, _ = self._read_layer(first, torch.zeros(1, dtype=torch.long), 1)  # one row: what a save holds per layer
        self.store.placed_on(kv_caches[first].device, self.tensor_parallel_rank(), self.tensor_parallel_size,
                             EntryShape(len(kv_caches), row_k.shape[1], row_k.shape[2], row_k.dtype))

    def attach_model(self, model: torch.nn.Module) -> None:
        """Hand the worker its model (kvbench's worker extension, over collective_rpc). Clients call
        it before every run (a server kvbench did not start has not had it yet): once attached, the
        same model is not attached again, so the method keeps its binding and what it shared with
        other instances stays on record (a re-bound method could not withdraw it at its reset)."""
        from kvbench.methods.core.forward import PartialForward
        from kvbench.methods.core.rope import RopeAligner

        if self._model is model:
            return
        inner = model.model
        layers = list(inner.layers)[inner.start_layer:inner.end_layer]
        names = [layer.self_attn.attn.layer_name for layer in layers]
        self.forward = PartialForward(model, names, self.layouts, self.kv_caches)
        self.aligner = RopeAligner(self.forward.rotary_emb).to(self.forward.device)  # keys are re-rotated there
        self._adapters = self._load_adapters(layers[0].self_attn)
        self.method.bind(self)
        self.check_method_fits(self.method)
        self._model = model
        logger.info("kvbench connector: model attached (%d layers)", len(layers))

    def _load_adapters(self, attention: torch.nn.Module) -> dict[str, VLora]:
        if not self.settings.adapters:  # (the rank needs vLLM's distributed state)
            return {}
        return served_adapters(self.settings.adapters, attention, self.num_layers, self.tensor_parallel_size,
                               self.tensor_parallel_rank())

    def check_method_fits(self, method: SharingMethod) -> None:
        check_method_fits(method, self.num_layers, adapters_served=bool(self._adapters))

    # ---------------------------------------------------------------- CoreServices for methods
    @property
    def num_layers(self) -> int:
        if self.forward is None:
            raise RuntimeError("model not attached")
        return len(self.forward.layers)

    @functools.cached_property
    def first_context_layer(self) -> int:  # read once: methods ask at every load
        from kvbench.model.store import first_context_layer

        return first_context_layer(self.model_path)

    def computed(self, req_id: str) -> bool:
        return self.computed_requests.computed(req_id)

    def when_prefilled(self, req_id: str, rows: torch.Tensor, deliver: RowsDelivery, key: str | None = None) -> None:
        """Hand `deliver` the K, V [layers, len(rows), Hkv, hd] of the request's `rows` once its
        prompt is computed (after the forward of the step that finishes it, its blocks still its
        own): rows vLLM prefilled itself are final only then. `key`: its stats key."""
        self.deliveries.ask(req_id, rows, deliver, key)

    @property
    def tensor_parallel_size(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()

    def tensor_parallel_rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() if self.tensor_parallel_size > 1 else 0

    def shared_state(self, namespace: str) -> Any:
        return self.store.shared_state(namespace)

    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        if self.tensor_parallel_size == 1:
            return partial
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(partial.contiguous())

    def context_free_prefill_steps(self, tokens: torch.Tensor, adapter: str | None = None,
                                   value_inputs: Callable[[int, torch.Tensor], None] | None = None
                                   ) -> Generator[int, None, SavedKV]:
        k, v = yield from self.forward.context_free_steps(tokens, lora=self.adapter(adapter), value_inputs=value_inputs)
        return SavedKV(tokens.clone(), k, v)

    def adapter(self, name: str | None) -> VLora | None:
        if name is None:
            return None
        if name not in self._adapters:
            raise MethodConfigError(f"adapter {name!r} was not given to kvbench's connector (kv_connector_extra_config"
                                    f"['adapters'] has {sorted(self._adapters) or 'none'}): its rows cannot be computed")
        return self._adapters[name]

    @property
    def adapters(self) -> dict[str, VLora]:
        return dict(self._adapters)

    # ---------------------------------------------------------------- helpers of the loads
    def rows_reader(self, block_ids: torch.Tensor) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Reads K, V [layers, len(rows), Hkv, hd] of a request's rows from the paged cache."""
        from kvbench.methods.core.paged import read_rows

        caches = [(self.layouts[name], self.kv_caches[name]) for name in self.forward.layer_names]
        return lambda rows: read_rows(caches, block_ids, rows, self.block_size)

    def influence(self, layer: int, q: torch.Tensor, q_rows: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Attention mass each row of the request receives at `layer` from the query rows `q_rows`
        (summed over them and the heads), over the K/V now in the paged cache."""
        from kvbench.methods.core.influence import attention_mass

        name = self.forward.layer_names[layer]
        keys, _ = self.layouts[name].read(self.kv_caches[name], block_ids, int(q_rows.max()) + 1)
        scale = self.forward.layers[layer].self_attn.attn.impl.scale
        return self.sum_over_ranks(attention_mass(q, q_rows, keys, scale)).cpu()  # over all heads

    def hidden_layer(self) -> int | None:
        """The layer whose entering residual stream the method recomputes from (None: none kept)."""
        group = self.method.recompute_layers()
        return group[0] if group is not None and group[0] > 0 else None

    def _keep_hidden(self, key: str, hidden: Hidden) -> None:
        self._hidden_for_save[key] = hidden
        while len(self._hidden_for_save) > MAX_PENDING_HIDDEN:  # requests aborted before their save
            self._hidden_for_save.pop(next(iter(self._hidden_for_save)))

    def note_exact_rows(self, key: str, rows: int) -> None:
        """A load's request `key` holds dense-prefill K/V in its first `rows` rows (kept for its save)."""
        self._exact_rows_for_save[key] = rows
        while len(self._exact_rows_for_save) > MAX_PENDING_HIDDEN:
            self._exact_rows_for_save.pop(next(iter(self._exact_rows_for_save)))

    def _finish_load(self, job: LoadJob, stats: LoadStats) -> None:
        self._record_stats(job.key, job.finished_stats(stats))

    def _record_stats(self, key: str, stats: LoadStats) -> None:
        self.request_stats[key] = stats
        self.reuse_counters.add_request(dict(stats))
        self._note_reuse_share(stats)
        while len(self.request_stats) > MAX_KEPT_REQUEST_STATS:
            self.request_stats.pop(next(iter(self.request_stats)))

    def _note_reuse_share(self, stats: LoadStats | dict[str, Any]) -> None:
        """The share of its eligible rows a turn reused, by agent, for the scheduler side's choice
        to claim that agent's next turn directly (ConnectorSettings.direct_claim_share)."""
        eligible, agent = stats.get("eligible_tokens") or 0, stats.get("agent")
        if agent and eligible > 0:
            self._reuse_shares[str(agent)] = float(stats.get("reused_tokens") or 0) / float(eligible)

    # ---------------------------------------------------------------- the engine step
    def start_load_kv(self, meta: KVBenchMetadata) -> None:
        self._do_saves(meta)  # first: a load or decision in this same step may read a source saved now
        self.computed_requests.step(frozenset(meta.prefilled))
        self._decide(meta.decides)
        self._run_deferred(meta.prefilling)
        layers = len(self.forward.layers) if self.forward is not None else 1
        self.loads.step(meta.loads, meta.scheduled_req_ids, layers)

    def _run_deferred(self, prefilling: bool) -> None:
        """The method's deferred work, in a step that computes no prompt tokens where one comes
        soon enough: in a step with a prefill it would land in that request's first token."""
        if prefilling and self._deferred_wait_steps < MAX_DEFERRED_WAIT_STEPS:
            self._deferred_wait_steps += 1
            return
        self._deferred_wait_steps = 0
        started = time.perf_counter()
        try:
            self.method.run_deferred()
        except Exception:  # method state updates must never take the engine down
            logger.exception("kvbench: deferred work of %s failed", self.method.name)
        self.deferred_s += time.perf_counter() - started  # off every request's first token, not off the step

    def _decide(self, specs: list[DecideSpec]) -> None:
        """Decide what each request reuses ahead of its claim; the claim then covers the rows up
        to the last reused one. A request that reuses nothing is vLLM's prefill: its decision's
        figures are recorded now and the method observes its rows once vLLM computed them."""
        for spec in specs:
            started = time.perf_counter()
            try:
                if self.forward is None:
                    raise RuntimeError("model not attached")
                with torch.inference_mode():
                    decision = run_to_end(decide_steps(self, spec, prompt_rows(spec)))
                stop = decision.claim_stop(self.settings.connector_row_cost)
            except Exception as exc:  # vLLM prefills it: a dense fallback before anything was placed
                logger.exception("kvbench: deciding %s failed; vLLM prefills it", spec.key)
                self._claims[spec.req_id] = spec.num_local
                self.request_stats[spec.key] = {"method": self.method.name, "fallback": "dense", "reused_tokens": 0,
                                                "error": f"{type(exc).__name__}: {exc}"}
                continue
            self._claims[spec.req_id] = stop
            if stop > spec.num_local:
                self._decisions[spec.req_id] = decision  # its load, in the step that claims it
                continue
            ctx = decision.ctx  # nothing to load: its figures now (the save adds vLLM's prefill's)
            stats: dict[str, Any] = {
                "method": self.method.name, "reused_tokens": 0, "decided_ahead_s": time.perf_counter() - started,
                "exact_prefix_tokens": 0, "ph_without_source_tokens": decision.found.missing,
                "source_missing_tokens": decision.found.evicted, "source_refused_tokens": decision.found.refused,
                "eligible_tokens": ctx.stats.pop("eligible_tokens", sum(len(c.dst) for c in decision.found.reuses)),
                "turn": spec.plan.turn, "agent": spec.plan.agent, **ctx.stats}
            ctx.stats = stats
            self.request_stats[spec.key] = cast(LoadStats, stats)  # counted on /metrics at its save
            self._note_reuse_share(stats)
            self._unclaimed_decisions[spec.key] = cast(LoadStats, stats)  # completed at its save
            while len(self._unclaimed_decisions) > MAX_PENDING_HIDDEN:  # requests aborted before their save
                self._unclaimed_decisions.pop(next(iter(self._unclaimed_decisions)))
            self.computed_requests.loaded(spec.req_id)  # what the method queues waits for vLLM's prefill
            try:
                self.method.after_load(ctx)
            except Exception:
                logger.exception("kvbench: %s after deciding %s failed", self.method.name, spec.key)

    def wait_for_save(self, meta: KVBenchMetadata) -> None:
        self._do_saves(meta)  # steps without loads (or without a forward) still save
        self._save_prompts(meta.prompt_saves)
        self.deliveries.deliver(meta.prefilled, self.rows_reader, self.request_stats)

    def _save_prompts(self, saves: list[SaveSpec]) -> None:
        """The prompts this step's forward finished, of requests a concurrent turn may read:
        into the store now (the request's whole save replaces the entry when it finishes). The
        method sees only that whole save (after_save)."""
        names = self.forward.layer_names if self.forward is not None else list(self.kv_caches)
        for save in saves:
            started = time.perf_counter()
            try:
                exact = None if save.unclaimed is not None else self._exact_rows_for_save.get(save.key, 0)
                entry = saved_copy(save, names, self._read_layer, self._hidden_for_save.get(save.key), exact)
                self.store.put(save.key, entry, save.adapter)
            except Exception:  # its readers then wait for its whole save
                logger.exception("kvbench: saving the prompt of %s failed", save.key)
                continue
            self._prompts_saved_this_step[save.key] = entry.num_tokens
            self._prompt_save_s[save.key] = time.perf_counter() - started
            while len(self._prompt_save_s) > MAX_PENDING_HIDDEN:  # requests aborted before their save
                self._prompt_save_s.pop(next(iter(self._prompt_save_s)))

    def _do_saves(self, meta: KVBenchMetadata) -> None:
        if self._saves_done_for is meta:
            return
        self._saves_done_for = meta
        names = self.forward.layer_names if self.forward is not None else list(self.kv_caches)
        for save in meta.saves:
            if save.unclaimed is not None:  # vLLM prefilled it: no load reported its figures
                # (a decision made ahead of its claim did: what it found and decided stays)
                decided = dict(self._unclaimed_decisions.pop(save.key, {}))
                if save.decide_wait_s is not None:
                    decided["decide_wait_s"] = save.decide_wait_s
                stats = cast(LoadStats, {**vllm_prefill_stats(self.method.name, *save.unclaimed), **decided})
                self.request_stats[save.key] = stats
                self.reuse_counters.add_request(dict(stats))
            if not save.keep:  # nothing reads its cache: nothing to copy before vLLM frees its blocks
                self._finished_sending.add(save.req_id)
                continue
            started = time.perf_counter()
            try:
                # vLLM prefilled an unclaimed request: exact throughout; a load said how far (none: it failed)
                exact = None if save.unclaimed is not None else self._exact_rows_for_save.pop(save.key, 0)
                entry = saved_copy(save, names, self._read_layer, self._hidden_for_save.pop(save.key, None), exact)
                encode_s = self.store.put(save.key, entry, save.adapter)
                self.method.after_save(save.key, entry, save.adapter)
                stats = self.request_stats.setdefault(save.key, {})
                self.reuse_counters.add_save(self.store.bytes)
                stats["save_s"] = time.perf_counter() - started
                if (prompt_save_s := self._prompt_save_s.pop(save.key, None)) is not None:
                    stats["prompt_save_s"] = prompt_save_s  # its prompt, saved at its prefill for concurrent readers
                stored = self.store.stored_nbytes(save.key)
                if stored is not None:  # what the store holds for it (compressed or not), measured
                    stats.update(store_entry_bytes=stored, store_entry_tokens=entry.num_tokens,
                                 store_encode_s=encode_s)
            except Exception:  # a failed save only means later consumers compute
                logger.exception("kvbench: saving %s failed", save.key)
            self._saved_this_step.add(save.key)  # confirmed either way, so consumers never hang
            self._finished_sending.add(save.req_id)

    def _read_layer(self, name: str, block_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layouts[name].read(self.kv_caches[name], block_ids, rows)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(saves done: blocks vLLM may free, loads ended, loads failed)."""
        self.computed_requests.finished(finished_req_ids)
        for req_id in finished_req_ids:  # (aborted before their prompt was computed, or never loaded)
            self._decisions.pop(req_id, None)
        self.deliveries.drop(finished_req_ids)
        done, self._finished_sending = self._finished_sending, set()
        failed = self.loads.take_failed()
        return done, self.loads.take_finished() | failed, failed  # a failure also ends the wait

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.take_failed_blocks()

    def build_worker_meta(self) -> KVBenchWorkerMetadata | None:
        if not (self._saved_this_step or self._claims or self._prompts_saved_this_step or self._reuse_shares):
            return None
        meta = KVBenchWorkerMetadata(self._saved_this_step, self._claims, self._prompts_saved_this_step,
                                     self._reuse_shares)
        self._saved_this_step, self._claims, self._prompts_saved_this_step, self._reuse_shares = set(), {}, {}, {}
        return meta

    def take_reuse_counts(self) -> dict[str, Any] | None:
        """What vLLM's connector-stats path carries from this step (kvbench.methods.connector.metrics)."""
        self.reuse_counters.add_counts(self.store.take_counts())  # the shared tier's, if any
        return self.reuse_counters.take(self.tensor_parallel_rank() if self.forward is not None else 0)

    # ---------------------------------------------------------------- worker RPCs
    def set_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Replace the method (same name, new parameters, empty state): e.g. to tune tau on one server."""
        method = type(self.method)({**self.method.params, **params})
        if method.loads_every_request() and not self._scheduler_loads_every_request:
            raise MethodConfigError(f"{method.name}: these parameters need every request loaded by the connector (its "
                                    "sources save a residual stream only their load captures), which the scheduler "
                                    "decided at start-up: start the server with them instead")
        if self.forward is not None:
            method.bind(self)  # first: a method may size itself by the model (DroidSpeak's default group)
            self.check_method_fits(method)
        self.method.reset()  # (what it shared with other instances withdrawn)
        self.method = method
        self.settings.params = dict(method.params)
        self.store.codec = params_codec(method.params)  # entries already held keep the codec they were kept with
        return dict(method.params)

    def reset_state(self, keep_method_state: bool = False) -> None:
        """Drop saved caches and per-request stats; also the method's learned state unless kept
        (warm-ups that prime anchor pools before a measured run)."""
        self.store.clear()
        self.deferred_s = 0.0
        self._hidden_for_save.clear()
        self._exact_rows_for_save.clear()
        self._prompt_save_s.clear()
        self._decisions.clear()
        self._unclaimed_decisions.clear()
        self.deliveries.clear()
        if keep_method_state:
            self.method.restart_peaks()
        else:
            self.method.reset()
        self.request_stats.clear()
