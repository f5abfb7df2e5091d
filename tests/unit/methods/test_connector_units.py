"""The connector's parts without a vLLM engine: settings, matching, the scheduler side's waits,
the loads' fallbacks and the row accounting."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.api.base import MethodConfigError
from kvbench.methods.connector.diagnostics import worker_stats
from kvbench.methods.connector.loads import AsyncLoads, LoadJob, SyncLoads
from kvbench.methods.connector.materialize import count_rows, find_candidates, served_entries
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.connector.specs import LoadSpec
from kvbench.methods.core.store import SavedKV, SegmentStore
from kvbench.methods.registry import method_class, method_keys

LAYERS, HEADS, HEAD_DIM = 2, 1, 4


@pytest.mark.parametrize("extra, message", [
    ({**method_keys("fullshared"), "colour": 1}, "unknown kv_connector_extra_config key"),
    ({"params": {}}, "needs 'method'"),
    ({**method_keys("fullshared"), "max_store_bytes": 0}, "max_store_bytes must be > 0"),
    ({**method_keys("fullshared"), "fault_injection": "sometimes"}, "fault_injection must be"),
    ({**method_keys("fullshared"), "fault_injection": "1.5"}, "fault_injection must be"),
    ({**method_keys("fullshared"), "max_load_tokens_per_step": -1}, "max_load_tokens_per_step must be"),
    ({**method_keys("fullshared"), "max_load_tokens_per_step": True}, "max_load_tokens_per_step must be"),
])
def test_connector_settings_reject_bad_config(extra: dict, message: str) -> None:
    with pytest.raises(MethodConfigError, match=message):
        ConnectorSettings.from_extra_config(extra)


def test_connector_settings_fault_modes_pick_their_loads() -> None:
    flagged = ConnectorSettings.from_extra_config({**method_keys("fullshared"), "fault_injection": "flagged"})
    assert flagged.fails_load("k", flagged=True) and not flagged.fails_load("k", flagged=False)
    every = ConnectorSettings.from_extra_config({**method_keys("fullshared"), "fault_injection": "all"})
    assert every.fails_load("k", flagged=False)
    assert not ConnectorSettings.from_extra_config({**method_keys("fullshared")}).fails_load("k", flagged=True)


def _saved(tokens: list[int]) -> SavedKV:
    n = len(tokens)
    return SavedKV(torch.tensor(tokens), torch.zeros(LAYERS, n, HEADS, HEAD_DIM), torch.zeros(LAYERS, n, HEADS, HEAD_DIM))


def _spec(segments: tuple[PlanSegment, ...], tokens: list[int], num_local: int = 0) -> LoadSpec:
    return LoadSpec("req", tokens + [0], [], num_local, len(tokens), Plan("t", "A1.r0", "A1", "run/t/A1.r0", segments))


def test_candidates_never_reuse_rows_of_other_tokens() -> None:
    store = SegmentStore(1 << 20)
    store.put("src", _saved([9, 9, 1, 2, 3, 4, 5, 6]))  # the segment at rows 2..7 of the source
    tokens = [7, 7, 7, 1, 2, 99, 4, 5, 6]  # the segment at rows 3..8, one token different
    spec = _spec((PlanSegment("pf", "system", 0, 3), PlanSegment("ph", "q", 3, 6, source="src", source_start=2)), tokens)
    found = find_candidates(store, spec, torch.tensor(tokens))
    (reuse,) = found.reuses
    assert reuse.dst.tolist() == [3, 4, 6, 7, 8] and reuse.src.tolist() == [2, 3, 5, 6, 7]
    assert found.missing == 1 and found.evicted == 0


def test_candidates_count_an_evicted_source_and_a_producers_last_token() -> None:
    store = SegmentStore(1 << 20)
    store.put("src", _saved([1, 2, 3]))  # a producer's cache lacks its last generated token
    tokens = [5, 1, 2, 3, 4, 4]
    spec = _spec((PlanSegment("pf", "system", 0, 1), PlanSegment("ph", "out:A0", 1, 4, source="src", source_start=0),
                  PlanSegment("ph", "q", 5, 1, source="gone", source_start=0)), tokens)
    found = find_candidates(store, spec, torch.tensor(tokens))
    assert [r.dst.tolist() for r in found.reuses] == [[1, 2, 3]]
    assert found.missing == 2 and found.evicted == 1  # the row past the producer's cache, the evicted q


def test_an_exact_prefix_is_the_longest_whole_blocks_of_the_same_tokens_inside_a_sources_exact_rows() -> None:
    """An agent's next round starts with its own earlier prompt: those rows, same tokens at the same
    positions before any reused row, are what a dense prefill computes; copied in whole blocks."""
    from kvbench.methods.connector.materialize import exact_prefix

    store = SegmentStore(1 << 20)
    earlier = _saved(list(range(10)))
    earlier.exact_rows = 10
    store.put("own", earlier)
    store.put("other", _saved(list(range(9)) + [77]))  # exact_rows 0: nothing known exact
    tokens = list(range(9)) + [50, 51, 52]
    spec = _spec((PlanSegment("pf", "system", 0, 4), PlanSegment("ph", "q", 4, 8, source="own", source_start=4),
                  PlanSegment("ph", "x", 10, 2, source="other", source_start=0)), tokens)
    source, stop = exact_prefix(store, spec, torch.tensor(tokens), block_size=4)
    assert source is store.get("own") and stop == 8  # 9 tokens in common, whole blocks of 4
    earlier.exact_rows = 6  # a reused row at 6: what follows it is approximate
    assert exact_prefix(store, spec, torch.tensor(tokens), block_size=4)[1] == 4
    assert exact_prefix(store, spec, torch.tensor(tokens), block_size=16) == (None, 0)


def test_an_exact_prefix_is_copied_only_from_a_cache_written_under_the_readers_adapter() -> None:
    """Two caches hold the reader's first rows: the one written under another adapter holds more of
    them, but its values are that adapter's, so the copy comes from the reader's own; and the
    rows copied are the source's own K/V, every layer, in the request's slots."""
    from kvbench.methods.connector.materialize import copy_exact_rows, exact_prefix

    store = SegmentStore(1 << 20)
    generator = torch.Generator().manual_seed(0)

    def cache(tokens: list[int]) -> SavedKV:
        n = len(tokens)
        entry = SavedKV(torch.tensor(tokens), torch.randn(LAYERS, n, HEADS, HEAD_DIM, generator=generator),
                        torch.randn(LAYERS, n, HEADS, HEAD_DIM, generator=generator))
        entry.exact_rows = n
        return entry

    store.put("mine", cache(list(range(8)) + [90, 91]))  # 8 rows in common, under the reader's adapter
    store.put("theirs", cache(list(range(12))))  # 12 in common, under another adapter
    tokens = list(range(12)) + [50]
    segments = (PlanSegment("ph", "q", 0, 8, source="mine", source_start=0, source_adapter="a"),
                PlanSegment("ph", "r", 8, 4, source="theirs", source_start=8, source_adapter="b"))
    spec = LoadSpec("req", tokens + [0], [], 0, len(tokens),
                    Plan("t", "A1.r1", "A1", "run/t/A1.r1", segments, adapter="a"))
    source, stop = exact_prefix(store, spec, torch.tensor(tokens), block_size=4)
    assert source is store.get("mine") and stop == 8
    caches = {f"layer{i}": torch.zeros(32, 2, HEADS, HEAD_DIM) for i in range(LAYERS)}

    class Layout:
        def write(self, kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            kv[slots, 0], kv[slots, 1] = k, v

    worker = SimpleNamespace(forward=SimpleNamespace(layer_names=list(caches)), layouts=dict.fromkeys(caches, Layout()),
                             kv_caches=caches)
    slots = torch.arange(16, 16 + len(tokens))
    copy_exact_rows(worker, source, 0, stop, slots)  # type: ignore[arg-type]
    for index, name in enumerate(caches):
        assert torch.equal(caches[name][16:24, 0], source.k[index, :8])
        assert torch.equal(caches[name][16:24, 1], source.v[index, :8])
        assert not caches[name][24:].any() and not caches[name][:16].any()  # nothing past the copied rows


def test_store_evicts_the_least_recently_used_first() -> None:
    one = _saved([1, 2, 3]).nbytes
    store = SegmentStore(2 * one)
    store.put("a", _saved([1, 2, 3]))
    store.put("b", _saved([1, 2, 3]))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", _saved([1, 2, 3]))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.evictions == 1


def _scheduler_output(scheduled: dict[str, int] | None = None, new: list[SimpleNamespace] | None = None,
                      cached: SimpleNamespace | None = None) -> SimpleNamespace:
    """What vLLM's scheduler hands build_connector_meta, with the fields the connector reads."""
    return SimpleNamespace(num_scheduled_tokens=scheduled or {}, scheduled_new_reqs=new or [],
                           scheduled_cached_reqs=cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                                           new_block_ids=[], num_computed_tokens=[]))


def _claim(scheduler: Any, request: SimpleNamespace, computed: int, stop: int) -> tuple[int | None, bool]:
    """The scheduler side's claim, through the decision round trip where the method decides first:
    the request waits one step (its DecideSpec goes out) and a worker answers `stop`."""
    from kvbench.methods.connector.metadata import KVBenchWorkerMetadata

    answer = scheduler.get_num_new_matched_tokens(request, computed)
    if answer != (None, False) or not scheduler.decides_first(scheduler.plan_of(request)):
        return answer
    decides = scheduler.build_connector_meta(_scheduler_output()).decides
    assert [d.req_id for d in decides] == [request.request_id] and decides[0].num_local == computed
    assert scheduler.get_num_new_matched_tokens(request, computed) == (None, False)  # no answer yet
    scheduler.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=KVBenchWorkerMetadata(set(), {request.request_id: stop}), failed_recving=None))
    return scheduler.get_num_new_matched_tokens(request, computed)


def _request(req_id: str, plan: Plan, prompt: int = 10, status: object = None, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=plan.to_params(), num_prompt_tokens=prompt,
                           prompt_token_ids=list(range(prompt)), status=status, num_computed_tokens=computed,
                           all_token_ids=list(range(prompt + 1)))


def test_a_consumer_waits_for_its_unsaved_source_and_an_aborted_producer_releases_it() -> None:
    from vllm.v1.request import RequestStatus

    from kvbench.methods.connector.metadata import KVBenchWorkerMetadata
    from kvbench.methods.connector.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys("fullshared")}),
                                   method_class("fullshared")({}))
    producer = _request("p", Plan("t", "A0.r0", "A0", "run/t/A0.r0"))
    consumer = _request("c", Plan("t", "A1.r0", "A1", "run/t/A1.r0",
                                  (PlanSegment("ph", "q", 0, 5, source="run/t/A0.r0", source_start=0),)))
    scheduler.on_new_request(producer)
    assert scheduler.get_num_new_matched_tokens(consumer, 0) == (None, False)  # waits
    # The producer finishes; its save is pending until a worker confirms it.
    finished = _request("p", Plan("t", "A0.r0", "A0", "run/t/A0.r0"), status=RequestStatus.FINISHED_STOPPED, computed=10)
    saving, params = scheduler.request_finished(finished, [1])
    assert saving and params == {"kvbench": {"save_as": "run/t/A0.r0", "num_tokens": 10}}
    assert scheduler.get_num_new_matched_tokens(consumer, 0) == (None, False)
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVBenchWorkerMetadata({"run/t/A0.r0"}),
                                                      failed_recving=None))
    assert scheduler.get_num_new_matched_tokens(consumer, 0) == (9, False)  # every prompt token but the last
    scheduler.update_state_after_alloc(consumer, SimpleNamespace(get_block_ids=lambda: [[1]]), 9)
    (load,) = scheduler.build_connector_meta(_scheduler_output(
        {"c": 1}, [SimpleNamespace(req_id="c", block_ids=([1],), num_computed_tokens=9, prompt_token_ids=[0] * 10)])).loads
    assert load.source_wait_s > 0  # how long it was held back, for `kvbench profile`

    other = _request("p2", Plan("t2", "A0.r0", "A0", "run/t2/A0.r0"))
    waiting = _request("c2", Plan("t2", "A1.r0", "A1", "run/t2/A1.r0",
                                  (PlanSegment("ph", "q", 0, 5, source="run/t2/A0.r0", source_start=0),)))
    scheduler.on_new_request(other)
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (None, False)
    assert scheduler.request_finished(_request("p2", Plan("t2", "A0.r0", "A0", "run/t2/A0.r0"),
                                               status=RequestStatus.FINISHED_ABORTED), []) == (False, None)
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (9, False)  # released, not hung


@pytest.mark.parametrize("method, params, loads_first", [
    ("fullshared", {}, False), ("kvcmas", {}, False), ("relaycaching", {}, False), ("cacheblend", {}, False),
    ("relaycaching", {"start_layer": 1}, True), ("droidspeak", {}, True), ("droidspeak", {"layers": [0, 4]}, False),
    ("kvcomm", {}, True), ("graphflow", {}, True)])
def test_a_request_that_reuses_nothing_is_left_to_vllm(method: str, params: dict, loads_first: bool) -> None:
    """A first agent names no source: vLLM prefills it in its own batches (no claim) and its
    figures come with its save, unless its method reuses something for it (a non-chained method's
    context-free reference) or must load every request (a source's saved residual stream)."""
    from vllm.v1.request import RequestStatus

    from kvbench.methods.connector.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys(method), "params": params}),
                                   method_class(method)(params))
    first = Plan("t", "A0.r0", "A0", "run/t/A0.r0", (PlanSegment("pf", "system", 0, 4), PlanSegment("ph", "q", 4, 6)))
    scheduler.on_new_request(_request("a0", first))
    assert _claim(scheduler, _request("a0", first), 2, stop=9) == ((7, False) if loads_first else (0, False))
    saving, _ = scheduler.request_finished(_request("a0", first, status=RequestStatus.FINISHED_STOPPED, computed=10), [1])
    (save,) = scheduler.build_connector_meta(_scheduler_output()).saves
    assert saving and save.key == "run/t/A0.r0"
    assert save.unclaimed == (None if loads_first else (10, 2))  # prompt tokens, vLLM's prefix-cache hit
    forced = Plan("t", "A0.r0", "A0", "k", first.segments, claim="all")
    assert scheduler.get_num_new_matched_tokens(_request("f", forced), 3) == (6, False)  # after vLLM's prefix hit
    never = Plan("t", "A1.r0", "A1", "k1", (PlanSegment("ph", "q", 4, 6, source="run/t/A0.r0", source_start=4),),
                 claim="none")
    assert scheduler.get_num_new_matched_tokens(_request("n", never), 0) == (0, False)


@pytest.mark.parametrize("method", ["fullshared", "kvcomm"])
def test_a_cache_no_later_turn_reads_is_not_kept(method: str) -> None:
    """A last agent's cache: no consumer waits for it and nothing is copied. A request the connector
    loaded reported its figures at its load (its blocks are freed at once); one vLLM prefilled
    reports them in the next step, which vLLM runs because its blocks are held until then."""
    from vllm.v1.request import RequestStatus

    from kvbench.methods.connector.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys(method)}), method_class(method)({}))
    last = Plan("t", "A3.r0", "A3", "run/t/A3.r0", (PlanSegment("pf", "system", 0, 4), PlanSegment("ph", "q", 4, 6)),
                keep_cache=False)
    assert last.saved_key is None and Plan.from_params(last.to_params()) == last
    scheduler.on_new_request(_request("a3", last))
    reader = Plan("t", "X", "X", "run/t/X", (PlanSegment("ph", "q", 0, 5, source="run/t/A3.r0", source_start=4),))
    assert _claim(scheduler, _request("x", reader), 0, stop=9) == (9, False)  # nothing to wait for
    claimed = _claim(scheduler, _request("a3", last), 2, stop=9)[0] > 0
    finished = _request("a3", last, status=RequestStatus.FINISHED_STOPPED, computed=10)
    assert scheduler.request_finished(finished, [1]) == (not claimed, None)
    saves = scheduler.build_connector_meta(_scheduler_output()).saves
    if claimed:  # kvcomm serves a first agent from its reference: the load reported it
        assert saves == []
    else:
        (save,) = saves
        assert not save.keep and save.key == "run/t/A3.r0" and save.unclaimed == (10, 2) and save.block_ids == []
        from kvbench.methods.connector.metadata import KVBenchMetadata
        from kvbench.methods.connector.worker import ConnectorWorker

        worker = ConnectorWorker(ConnectorSettings.from_extra_config({**method_keys(method)}), method_class(method)({}),
                                 block_size=16, static_forward_context={})
        worker.wait_for_save(KVBenchMetadata(saves=[save]))
        stats = worker_stats(worker, clear=False)
        assert stats.requests["run/t/A3.r0"]["local_tokens"] == 2 and "save_s" not in stats.requests["run/t/A3.r0"]
        assert stats.store_entries == 0 and worker.get_finished(set())[0] == {"a3"}  # its blocks: nothing copied
        assert worker.take_reuse_counts() == {"requests": 1, "claimed_requests": 0, "reused_tokens": 0,
                                              "recomputed_tokens": 7, "eligible_tokens": 0, "source_missing_tokens": 0,
                                              "exact_prefix_tokens": 0, "fallbacks": 0}
        assert worker.take_reuse_counts() is None  # taken once


def test_an_unclaimed_request_reports_what_vllm_computed() -> None:
    from kvbench.contracts import vllm_prefill_stats

    stats = vllm_prefill_stats("fullshared", prompt_tokens=100, prefix_cached=32)
    assert stats["reused_tokens"] == 0 and stats["recomputed_tokens"] == 67 and stats["local_tokens"] == 32
    assert stats["claimed"] is False and stats["claimed_tokens"] == 0


def test_an_unreadable_plan_is_served_without_the_connector() -> None:
    from kvbench.methods.connector.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys("fullshared")}),
                                   method_class("fullshared")({}))
    request = _request("r", Plan("t", "A0.r0", "A0", "k"))
    request.kv_transfer_params["kvbench"]["version"] = 999
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)


def _failing_work(spec: LoadSpec):
    yield 5
    raise RuntimeError("boom")


def test_a_failed_synchronous_load_hands_its_blocks_back_to_vllm() -> None:
    done: list = []
    loads = SyncLoads(_failing_work, lambda job, stats: done.append(stats), block_size=4)
    spec = LoadSpec("r", list(range(13)), [10, 11, 12], 4, 12, Plan("t", "A1", "A1", "k"))
    loads.step([spec], frozenset({"r"}), layers=2)
    assert done[0]["fallback"] == "dense" and "boom" in done[0]["error"] and done[0]["recomputed_tokens"] == 8
    assert loads.take_failed_blocks() == {11, 12}  # the blocks past vLLM's own prefix-cache hit
    assert loads.take_failed() == set() and loads.take_finished() == set()


def test_a_failed_asynchronous_load_ends_the_wait_as_failed() -> None:
    done: list = []
    loads = AsyncLoads(_failing_work, lambda job, stats: done.append(stats), block_size=4, tokens_per_step=1)
    spec = LoadSpec("r", list(range(13)), [10, 11, 12], 0, 12, Plan("t", "A1", "A1", "k"))
    loads.step([spec], frozenset(), layers=2)  # one layer's worth of budget: the load pauses
    assert not done and len(loads.queue) == 1
    loads.step([], frozenset(), layers=2)
    assert done[0]["fallback"] == "dense"
    assert loads.take_failed() == {"r"} and loads.take_finished() == {"r"} and loads.take_failed_blocks() == set()


def test_finished_stats_say_where_the_load_ran() -> None:
    job = LoadJob(LoadSpec("r", [1, 2, 3], [0], 1, 2, Plan("t", "A1.r0", "A1", "k")), iter(()))
    stats = job.finished_stats({"reused_tokens": 1, "recomputed_tokens": 0})
    assert stats["turn"] == "A1.r0" and stats["agent"] == "A1" and stats["claimed_tokens"] == 1
    assert stats["local_tokens"] == 1 and stats["load_s"] >= 0


@pytest.mark.parametrize("check, group, stages, expected, entries", [
    (None, None, [], (6, 4), 24),  # plain reuse: reused rows reused in every layer, the rest computed
    (1, None, [(1, 2)], (4, 6), 8),  # CacheBlend: every row computes layers 0-1; 2 reused rows picked for the rest
    # gradual filtering: all 6 compute layers 0-1 (12 entries), 4 kept compute layer 2 (4), 1 kept layer 3 (1)
    (1, None, [(1, 4), (2, 1)], (5, 5), 24 - 12 - 4 - 1),
    (None, (2, 4), [], (3, 7), 12),  # DroidSpeak: 6 reused rows computed in 2 of 4 layers
    (2, (1, 4), [(2, 1)], (3, 7), 11),  # a group checked at layer 2: all compute 1-2, the picked row also layer 3
])
def test_row_accounting(check: int | None, group: tuple[int, int] | None, stages: list[tuple[int, int]],
                        expected: tuple[int, int], entries: int) -> None:
    reused = torch.zeros(10, dtype=torch.bool)
    reused[4:] = True
    compute = torch.arange(10) if check is not None and group is None else torch.arange(4)
    assert count_rows(reused, compute, stages, check, group, layers=4) == expected
    assert served_entries(6, stages, check, group, layers=4) == entries


def test_parameters_that_need_every_request_loaded_are_refused_after_start_up() -> None:
    """The scheduler side decided at start-up which requests the connector loads; new parameters
    that need every request loaded (a stream saved past layer 0) would find sources without one."""
    from kvbench.methods.api.base import MethodConfigError
    from kvbench.methods.connector.worker import ConnectorWorker

    settings = ConnectorSettings.from_extra_config({**method_keys("relaycaching")})
    worker = ConnectorWorker(settings, method_class("relaycaching")({}), 16, {})
    with pytest.raises(MethodConfigError, match="start the server with them"):
        worker.set_params({"start_layer": 1})
    assert worker.set_params({"tau_dev": 2.0})["tau_dev"] == 2.0 and worker.method.params["start_layer"] == 0


def test_a_method_that_decides_first_claims_up_to_its_last_reused_row_and_vllm_prefills_the_rest() -> None:
    """KVCMAS's gate may send segments dense: the worker decides one step ahead, the claim covers
    the rows through the last reused one, vLLM prefills the rest (all of it when the gate sent
    everything dense), and the scheduler marks the step that finishes each prompt, chunked or not,
    with every block the request holds."""
    from vllm.v1.request import RequestStatus

    from kvbench.methods.connector.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys("kvcmas")}), method_class("kvcmas")({}))
    segments = (PlanSegment("pf", "system", 0, 4), PlanSegment("ph", "q", 4, 6, source="run/t/A0.r0", source_start=4),
                PlanSegment("pf", "text", 10, 2), PlanSegment("ph", "out:A0.r0", 12, 6, source="run/t/A0.r0",
                                                              source_start=12))
    plan = Plan("t", "A1.r0", "A1", "run/t/A1.r0", segments)
    partly = _request("c", plan, prompt=21)
    assert _claim(scheduler, partly, 0, stop=10) == (10, False)  # q reused; out:A0.r0 sent dense
    scheduler.update_state_after_alloc(partly, SimpleNamespace(get_block_ids=lambda: [[7, 8, 9]]), 10)
    meta = scheduler.build_connector_meta(_scheduler_output(
        {"c": 11}, [SimpleNamespace(req_id="c", block_ids=([7, 8, 9],), num_computed_tokens=10,
                                    prompt_token_ids=list(range(21)))]))
    (load,) = meta.loads
    assert (load.num_local, load.num_target) == (0, 10)  # the connector's rows; vLLM computes 10..20 in this step
    assert meta.prefilled == {"c": [7, 8, 9]} and meta.prefilling

    dense_plan = Plan("t", "A2.r0", "A2", "run/t/A2.r0", segments)
    dense = _request("d", dense_plan, prompt=21)
    assert _claim(scheduler, dense, 4, stop=4) == (0, False)  # the gate sent every segment dense: vLLM's prefill
    scheduler.update_state_after_alloc(dense, SimpleNamespace(get_block_ids=lambda: [[1]]), 0)
    first = scheduler.build_connector_meta(_scheduler_output(
        {"d": 8}, [SimpleNamespace(req_id="d", block_ids=([1, 2],), num_computed_tokens=4,
                                   prompt_token_ids=list(range(21)))]))
    assert first.loads == [] and first.prefilled == {}  # a chunk: its prompt is not computed yet
    rest = scheduler.build_connector_meta(_scheduler_output(
        {"d": 9}, cached=SimpleNamespace(req_ids=["d"], resumed_req_ids=set(), new_block_ids=[([3, 4],)],
                                         num_computed_tokens=[12])))
    assert rest.prefilled == {"d": [1, 2, 3, 4]} and rest.prefilling
    decode = scheduler.build_connector_meta(_scheduler_output(
        {"d": 1}, cached=SimpleNamespace(req_ids=["d"], resumed_req_ids=set(), new_block_ids=[None],
                                         num_computed_tokens=[21])))
    assert decode.prefilled == {} and not decode.prefilling  # a decode step computes no prompt tokens
    saving, _ = scheduler.request_finished(_request("d", dense_plan, prompt=21, status=RequestStatus.FINISHED_STOPPED,
                                                    computed=22), [1])
    (save,) = scheduler.build_connector_meta(_scheduler_output()).saves
    assert saving and save.unclaimed == (21, 4)  # its figures: vLLM's prefill above its prefix-cache hit


def test_an_agent_whose_last_turn_reused_most_is_claimed_without_a_decision_step() -> None:
    """Deciding first costs an engine step; an agent whose last turn reused at least
    direct_claim_share of its eligible rows is claimed at once (its load decides), one whose last
    turn went dense decides first again. The choice holds for the request once made."""
    from kvbench.methods.connector.metadata import KVBenchWorkerMetadata
    from kvbench.methods.connector.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys("kvcmas")}), method_class("kvcmas")({}))
    segments = (PlanSegment("ph", "q", 4, 6, source="run/t/A0.r0", source_start=4),)
    cold = _request("a", Plan("t", "A1.r0", "A1", "run/t/A1.r0", segments), prompt=12)
    assert scheduler.get_num_new_matched_tokens(cold, 0) == (None, False)  # no history: it decides first
    # The worker reports A1's turn (its load reused 95% of what it could) and A2's (dense).
    scheduler.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=KVBenchWorkerMetadata(reuse_shares={"A1": 0.95, "A2": 0.0}), failed_recving=None))
    assert scheduler.get_num_new_matched_tokens(cold, 0) == (None, False)  # still its decision's: chosen once
    warm = _request("b", Plan("t2", "A1.r0", "A1", "run/t2/A1.r0", segments), prompt=12)
    assert scheduler.get_num_new_matched_tokens(warm, 0) == (11, False)  # claimed at once
    dense = _request("c", Plan("t2", "A2.r0", "A2", "run/t2/A2.r0", segments), prompt=12)
    assert scheduler.get_num_new_matched_tokens(dense, 0) == (None, False)
    # Above 1: always decides first.
    always = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys("kvcmas"), "direct_claim_share": 1.01}),
                                method_class("kvcmas")({}))
    always.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=KVBenchWorkerMetadata(reuse_shares={"A1": 1.0}), failed_recving=None))
    later = _request("d", Plan("t3", "A1.r0", "A1", "run/t3/A1.r0", segments), prompt=12)
    assert always.get_num_new_matched_tokens(later, 0) == (None, False)


def test_the_worker_reports_each_agents_reused_share_once() -> None:
    from kvbench.methods.connector.worker import ConnectorWorker

    worker = ConnectorWorker(ConnectorSettings.from_extra_config({**method_keys("kvcmas")}), method_class("kvcmas")({}),
                             block_size=4, static_forward_context={})
    worker._record_stats("run/t/A1.r0", {"agent": "A1", "eligible_tokens": 100, "reused_tokens": 80})  # type: ignore[typeddict-unknown-key]
    worker._record_stats("run/t/A0.r0", {"agent": "A0", "eligible_tokens": 0, "reused_tokens": 0})  # type: ignore[typeddict-unknown-key]
    meta = worker.build_worker_meta()
    assert meta is not None and meta.reuse_shares == {"A1": 0.8}  # A0 could reuse nothing: no figure
    assert worker.build_worker_meta() is None


def test_rows_of_a_request_are_delivered_after_the_forward_that_finishes_its_prompt() -> None:
    """The method's observations of rows vLLM prefilled: delivered in wait_for_save of the step
    that finished the prompt (its blocks still its own), read through the request's blocks; a
    request that ends first delivers nothing."""
    from kvbench.methods.connector.metadata import KVBenchMetadata
    from kvbench.methods.connector.worker import ConnectorWorker

    block_size = 4
    caches = {f"layer{i}": torch.randn(8, 2, block_size, HEADS, HEAD_DIM) for i in range(LAYERS)}

    class Layout:
        def read(self, kv: torch.Tensor, block_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            blocks = kv[block_ids]  # [blocks, 2, block size, H, hd]
            k = blocks[:, 0].reshape(-1, HEADS, HEAD_DIM)[:rows]
            v = blocks[:, 1].reshape(-1, HEADS, HEAD_DIM)[:rows]
            return k, v

    worker = ConnectorWorker(ConnectorSettings.from_extra_config({**method_keys("kvcmas")}), method_class("kvcmas")({}),
                             block_size=block_size, static_forward_context={})
    worker.forward = SimpleNamespace(layer_names=list(caches))
    worker.layouts, worker.kv_caches = dict.fromkeys(caches, Layout()), caches
    delivered: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows = torch.tensor([1, 5, 6])
    worker.when_prefilled("r", rows, lambda k, v: delivered.append((k, v)))
    worker.when_prefilled("gone", rows, lambda k, v: delivered.append((k, v)))
    worker.wait_for_save(KVBenchMetadata())
    assert delivered == []  # not before its prompt is computed
    worker.get_finished({"gone"})  # ended before: nothing waits for it any more
    worker.wait_for_save(KVBenchMetadata(prefilled={"r": [3, 6], "gone": [0]}))
    (k, v), = delivered
    for index, name in enumerate(caches):  # row 1 in block 3, rows 5 and 6 in block 6
        expected_k = torch.stack([caches[name][3, 0, 1], caches[name][6, 0, 1], caches[name][6, 0, 2]])
        expected_v = torch.stack([caches[name][3, 1, 1], caches[name][6, 1, 1], caches[name][6, 1, 2]])
        assert torch.equal(k[index], expected_k) and torch.equal(v[index], expected_v)


def test_a_decided_claim_ends_where_the_rows_the_connector_would_compute_cost_more_than_the_reuse_saves() -> None:
    """The claim stops at the end of a reused segment, or claims nothing: a large segment sent dense
    ahead of a few reused rows goes to vLLM's prefill with them (the connector's forward costs
    `row_cost` vLLM rows a row); a short glue ahead of a long reuse is the connector's."""
    from kvbench.methods.api.base import LoadContext, SegmentReuse
    from kvbench.methods.connector.materialize import Candidates, LoadDecision

    def decision(reused: list[tuple[int, int]], n: int = 1000, local: int = 0) -> LoadDecision:
        source = _saved(list(range(n)))
        chosen = [SegmentReuse(PlanSegment("ph", f"s{start}", start, stop - start, source="k", source_start=start),
                               source, torch.arange(start, stop), torch.arange(start, stop)) for start, stop in reused]
        ctx = LoadContext("key", Plan("t", "A1.r0", "A1", "key"), torch.arange(n), local, chosen,
                          read_rows=lambda rows: (rows, rows),
                          stats={"decisions": [{"id": r.segment.id, "decision": "accepted"} for r in chosen]})
        return LoadDecision(local, None, 0, Candidates(), ctx, chosen)

    nothing = decision([])
    assert nothing.claim_stop(1.5) == 0  # vLLM prefills it all
    glue_then_reuse = decision([(20, 900)])
    assert glue_then_reuse.claim_stop(1.5) == 900 and len(glue_then_reuse.chosen) == 1
    dense_then_few = decision([(850, 900), (900, 950)])  # 850 rows sent dense, then 100 reused
    assert dense_then_few.claim_stop(1.5) == 0 and dense_then_few.chosen == []
    assert all(d["prefilled_by_vllm"] for d in dense_then_few.ctx.stats["decisions"])
    assert decision([(850, 900), (900, 950)]).claim_stop(1.0) == 950  # as cheap as vLLM: every reuse pays
    mixed = decision([(10, 600), (700, 720)], local=4)  # a reuse worth it, then a dense gap before a short one
    assert mixed.claim_stop(1.5) == 600 and [r.segment.id for r in mixed.chosen] == ["s10"]
    assert [d.get("prefilled_by_vllm", False) for d in mixed.ctx.stats["decisions"]] == [False, True]


def test_a_decision_goes_out_with_the_save_of_the_source_it_waits_for() -> None:
    """The worker saves before it decides in a step: a consumer whose last source is being saved in
    the next step is decided in that same step, not one step after it."""
    from vllm.v1.request import RequestStatus

    from kvbench.methods.connector.metadata import KVBenchWorkerMetadata
    from kvbench.methods.connector.scheduler import ConnectorScheduler

    scheduler = ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys("kvcmas")}), method_class("kvcmas")({}))
    source_plan = Plan("t", "A0.r0", "A0", "run/t/A0.r0")
    consumer = _request("c", Plan("t", "A1.r0", "A1", "run/t/A1.r0",
                                  (PlanSegment("ph", "q", 0, 5, source="run/t/A0.r0", source_start=0),)))
    scheduler.on_new_request(_request("p", source_plan))
    assert scheduler.get_num_new_matched_tokens(consumer, 0) == (None, False)
    assert scheduler.build_connector_meta(_scheduler_output()).decides == []  # its source is still running
    scheduler.request_finished(_request("p", source_plan, status=RequestStatus.FINISHED_STOPPED, computed=10), [1])
    assert scheduler.get_num_new_matched_tokens(consumer, 0) == (None, False)
    meta = scheduler.build_connector_meta(_scheduler_output())
    assert [s.key for s in meta.saves] == ["run/t/A0.r0"] and [d.req_id for d in meta.decides] == ["c"]
    scheduler.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=KVBenchWorkerMetadata({"run/t/A0.r0"}, {"c": 5}), failed_recving=None))
    assert scheduler.get_num_new_matched_tokens(consumer, 0) == (5, False)


def test_the_worker_side_offers_every_service_methods_and_loads_use() -> None:
    """Methods and loads reach the worker side through CoreServices and LoadServices: a member the
    worker lost (a refactor) would fail inside vLLM, at the first load."""
    import inspect

    from kvbench.methods.api.base import CoreServices
    from kvbench.methods.connector.materialize import LoadServices
    from kvbench.methods.connector.worker import ConnectorWorker

    worker = ConnectorWorker(ConnectorSettings.from_extra_config({**method_keys("kvcmas")}), method_class("kvcmas")({}),
                             block_size=16, static_forward_context={})
    wanted = set()
    for protocol in (CoreServices, LoadServices):
        wanted |= set(getattr(protocol, "__annotations__", {}))
        wanted |= {name for name, _ in inspect.getmembers(protocol) if not name.startswith("_")}
    wanted -= set(dir(object)) | {"_is_protocol"}
    missing = sorted(name for name in wanted
                     if not hasattr(ConnectorWorker, name) and name not in vars(worker))
    assert missing == []
    assert {"num_layers", "tensor_parallel_size", "when_prefilled", "sum_over_ranks"} <= wanted


def test_rows_are_read_from_the_blocks_holding_them_in_the_order_asked() -> None:
    """read_rows reads only the blocks the rows lie in, whatever their order; through vLLM 0.32's
    GPU layout (a logical [blocks, Hkv, block size, 2 x head size] view) on host tensors."""
    from kvbench.methods.core.paged import KVHalvesLayout, read_rows

    block_size = 4
    caches = [torch.randn(10, HEADS, block_size, 2 * HEAD_DIM) for _ in range(LAYERS)]
    block_ids = torch.tensor([7, 2, 4])  # the request's rows 0-3, 4-7, 8-11
    rows = torch.tensor([9, 0, 5, 1])
    k, v = read_rows([(KVHalvesLayout(HEAD_DIM), cache) for cache in caches], block_ids, rows, block_size)
    for layer, cache in enumerate(caches):
        for i, row in enumerate(rows.tolist()):
            block, slot = int(block_ids[row // block_size]), row % block_size
            assert torch.equal(k[layer, i], cache[block, :, slot, :HEAD_DIM])
            assert torch.equal(v[layer, i], cache[block, :, slot, HEAD_DIM:])
