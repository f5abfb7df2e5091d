"""Agents reading one document at the same time (issue 51, item 7): the replay names an earlier
concurrent turn as the source of a segment no predecessor holds, the connector saves that turn's
prompt right after the forward that computes it, and the reader goes ahead then instead of waiting
for the source's decode. Scheduler and worker sides without a vLLM engine; the engine tier replays
a fan-in in vLLM (test_replay_vllm.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.connector import scheduler as scheduler_module
from kvbench.methods.connector.metadata import KVBenchMetadata, KVBenchWorkerMetadata
from kvbench.methods.connector.scheduler import ConnectorScheduler
from kvbench.methods.connector.settings import ConnectorSettings
from kvbench.methods.registry import method_class, method_keys
from kvbench.replay.prompts import PromptBuilder
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.stats import trace_stats

SOURCE, READER = "run/t/A0.r0", "run/t/A1.r0"
PROMPT = 10


def _request(req_id: str, plan: Plan, prompt: int = PROMPT) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=plan.to_params(), num_prompt_tokens=prompt,
                           prompt_token_ids=list(range(prompt)), status=None, num_computed_tokens=0,
                           all_token_ids=list(range(prompt + 1)))


def _output(scheduled: dict[str, int], new: list[SimpleNamespace] | None = None) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_new_reqs=new or [],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                                 num_computed_tokens=[]))


def _worker_says(scheduler: ConnectorScheduler, meta: KVBenchWorkerMetadata) -> None:
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta, failed_recving=None))


def _source_plan() -> Plan:
    return Plan("t", "A0.r0", "A0", SOURCE, (PlanSegment("ph", "q", 2, 6),), readable_after_prefill=True)


def _reader_plan(stop: int = 8, in_flight: bool = True) -> Plan:
    """Reads the source's rows [2, stop) (q: its prompt; past PROMPT: its output)."""
    return Plan("t", "A1.r0", "A1", READER,
                (PlanSegment("ph", "q", 3, stop - 2, source=SOURCE, source_start=2, source_turn="A0.r0"),),
                sources_in_flight=(SOURCE,) if in_flight else ())


def _scheduler() -> ConnectorScheduler:
    return ConnectorScheduler(ConnectorSettings.from_extra_config({**method_keys("fullshared")}), method_class("fullshared")({}))


def test_a_reader_goes_ahead_once_the_sources_prompt_is_saved_not_its_whole_cache() -> None:
    scheduler = _scheduler()
    source, reader = _request("s", _source_plan()), _request("r", _reader_plan())
    scheduler.on_new_request(source)
    assert scheduler.get_num_new_matched_tokens(source, 0) == (0, False)  # nothing to reuse: vLLM prefills it
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (None, False)  # its source is being computed
    # A first chunk of the source's prompt: no save yet.
    chunk = SimpleNamespace(req_id="s", block_ids=([4, 5],), num_computed_tokens=0, prompt_token_ids=list(range(PROMPT)))
    assert scheduler.build_connector_meta(_output({"s": 6}, [chunk])).prompt_saves == []
    # The step that finishes the prompt hands the worker its prompt and every block, to save after the forward.
    output = _output({"s": 4})
    output.scheduled_cached_reqs = SimpleNamespace(req_ids=["s"], resumed_req_ids=set(), new_block_ids=[([6],)],
                                                   num_computed_tokens=[6])
    meta = scheduler.build_connector_meta(output)
    (save,) = meta.prompt_saves
    assert (save.key, save.token_ids, save.block_ids) == (SOURCE, list(range(PROMPT)), [4, 5, 6])
    assert save.unclaimed is not None  # vLLM prefilled it: its rows are exact
    assert meta.prefilled == {"s": [4, 5, 6]}
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (None, False)  # not confirmed yet
    _worker_says(scheduler, KVBenchWorkerMetadata(prompt_saved={SOURCE: PROMPT}))
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (PROMPT - 1, False)  # claimed while the source decodes
    # A reader of the source's output rows still waits for its whole save.
    late = _request("r2", Plan("t", "A2.r0", "A2", "run/t/A2.r0", (
        PlanSegment("ph", "out:A0.r0", 0, 4, source=SOURCE, source_start=PROMPT, source_turn="A0.r0"),)))
    assert scheduler.get_num_new_matched_tokens(late, 0) == (None, False)
    _worker_says(scheduler, KVBenchWorkerMetadata({SOURCE}))
    assert scheduler.get_num_new_matched_tokens(late, 0) == (PROMPT - 1, False)


def test_a_reader_sent_with_its_source_waits_for_it_to_arrive_and_not_for_ever() -> None:
    scheduler = _scheduler()
    reader = _request("r", _reader_plan())
    # The source was sent just before but reached the engine after the reader: the reader waits for it.
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (None, False)
    scheduler.on_new_request(_request("s", _source_plan()))
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (None, False)  # now for its prompt
    # A source that never comes (its request failed on the way) holds a reader for the grace only.
    lost = _request("r3", Plan("t", "A3.r0", "A3", "run/t/A3.r0", (PlanSegment(
        "ph", "q", 3, 6, source="run/t/gone", source_start=2, source_turn="A9.r0"),), sources_in_flight=("run/t/gone",)))
    assert scheduler.get_num_new_matched_tokens(lost, 0) == (None, False)
    scheduler_module.IN_FLIGHT_GRACE_S, grace = 0.0, scheduler_module.IN_FLIGHT_GRACE_S
    try:
        assert scheduler.get_num_new_matched_tokens(lost, 0) == (PROMPT - 1, False)  # the worker finds no source: dense
    finally:
        scheduler_module.IN_FLIGHT_GRACE_S = grace


def test_an_aborted_source_releases_its_readers() -> None:
    from vllm.v1.request import RequestStatus

    scheduler = _scheduler()
    source, reader = _request("s", _source_plan()), _request("r", _reader_plan())
    scheduler.on_new_request(source)
    scheduler.get_num_new_matched_tokens(source, 0)
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (None, False)
    source.status = RequestStatus.FINISHED_ABORTED
    assert scheduler.request_finished(source, []) == (False, None)
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (PROMPT - 1, False)


def test_the_worker_saves_a_prompt_after_the_forward_and_its_whole_save_replaces_it() -> None:
    from kvbench.methods.connector.specs import SaveSpec
    from kvbench.methods.connector.worker import ConnectorWorker

    block_size, heads, head_dim = 4, 1, 2
    caches = {f"layer{i}": torch.randn(8, 2, block_size, heads, head_dim) for i in range(2)}

    class Layout:
        def read(self, kv: torch.Tensor, block_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            blocks = kv[block_ids]
            return blocks[:, 0].reshape(-1, heads, head_dim)[:rows], blocks[:, 1].reshape(-1, heads, head_dim)[:rows]

    worker = ConnectorWorker(ConnectorSettings.from_extra_config({**method_keys("fullshared")}), method_class("fullshared")({}),
                             block_size=block_size, static_forward_context={})
    worker.forward = SimpleNamespace(layer_names=list(caches), layers=list(caches))
    worker.layouts, worker.kv_caches = dict.fromkeys(caches, Layout()), caches
    prompt = SaveSpec("s", SOURCE, list(range(6)), [3, 1], unclaimed=(6, 0))
    worker.start_load_kv(KVBenchMetadata(prompt_saves=[prompt]))
    assert worker.store.get(SOURCE) is None  # not before the forward
    worker.wait_for_save(KVBenchMetadata(prompt_saves=[prompt]))
    entry = worker.store.get(SOURCE)
    assert entry is not None and entry.num_tokens == 6 and entry.exact_rows == 6
    assert torch.equal(entry.k[1, 4], caches["layer1"][1, 0, 0])  # row 4: block 1, slot 0
    meta = worker.build_worker_meta()
    assert meta is not None and meta.prompt_saved == {SOURCE: 6} and meta.saved_keys == set()
    # The request finishes: its whole cache (prompt and output) replaces the prompt's entry.
    whole = SaveSpec("s", SOURCE, list(range(8)), [3, 1], unclaimed=(6, 0))
    worker.wait_for_save(KVBenchMetadata(saves=[whole]))
    assert worker.store.get(SOURCE).num_tokens == 8 and len(worker.store.entries) == 1
    assert "prompt_save_s" in worker.request_stats[SOURCE]
    final = worker.build_worker_meta()
    assert final is not None and final.saved_keys == {SOURCE} and final.prompt_saved == {}


def _fan_in(tokenizer: Any, trajectories: int = 1) -> Trace:
    header, items = generate_trace(TraceSpec(workflow="fan-in", num_agents=4, shared_tokens=40, output_len=4,
                                             num_trajectories=trajectories, seed=1), tokenizer)
    return Trace(header=header, trajectories=items)


@pytest.mark.parametrize("concurrent", [True, False])
def test_parallel_readers_name_the_first_one_sent_as_their_source(tiny_tokenizer_dir, concurrent: bool) -> None:
    from kvbench.tracegen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    (trajectory,) = _fan_in(tokenizer).trajectories  # A0, A1, A2 in parallel, then A3
    builder = PromptBuilder(tokenizer, [], run_id="run", concurrent_sources=concurrent)
    started: dict = {}
    plans = {}
    for turn in trajectory.turns[:3]:
        prompt = builder.build(trajectory, turn, {}, {}, started)
        started[turn.turn_id] = prompt
        plans[turn.turn_id] = prompt.plan
    key = f"run/{trajectory.trajectory_id}/A0.r0"
    q_source = {t: next(s.source for s in plan.segments if s.id == "q") for t, plan in plans.items()}
    if not concurrent:
        assert set(q_source.values()) == {None} and not any(p.readable_after_prefill for p in plans.values())
        return
    assert q_source == {"A0.r0": None, "A1.r0": key, "A2.r0": key}  # the earliest, never a later one: no cycle
    assert plans["A0.r0"].readable_after_prefill and plans["A0.r0"].keep_cache
    assert plans["A1.r0"].sources_in_flight == (key,) and plans["A1.r0"].rows_read_from(key) is not None
    # Only turns already sent are read from: A1 built before A0 was sent reads nothing.
    alone = PromptBuilder(tokenizer, [], run_id="run").build(trajectory, trajectory.turns[1], {}, {}, {})
    assert all(s.source is None for s in alone.plan.segments)
    # The aggregator reads q from its predecessors (finished), not as a concurrent reader.
    outputs = {t: [5, 6, 7, 8] for t in plans}
    last = builder.build(trajectory, trajectory.turns[3], outputs, dict(started), started)
    assert last.plan.sources_in_flight == () and all(s.source for s in last.plan.segments if s.kind == "ph")


def test_trace_stats_show_segments_shared_by_concurrent_turns(tiny_tokenizer_dir) -> None:
    from kvbench.tracegen.tokenizer import load_tokenizer

    stats = trace_stats(_fan_in(load_tokenizer(str(tiny_tokenizer_dir)), trajectories=2))
    assert stats["concurrent_shared_tokens_per_edge"] == {"A0->A1": 40.0, "A0->A2": 40.0}
    sequential = generate_trace(TraceSpec(shared_tokens=40, output_len=4, num_trajectories=1, seed=1),
                                load_tokenizer(str(tiny_tokenizer_dir)))
    assert trace_stats(Trace(header=sequential[0], trajectories=sequential[1]))["concurrent_shared_tokens_per_edge"] == {}


def test_tensor_parallel_ranks_report_the_smaller_figures() -> None:
    ours = KVBenchWorkerMetadata({"a"}, {"r": 8}, {SOURCE: 10}, {"A1": 0.9})
    theirs = KVBenchWorkerMetadata({"b"}, {"r": 6, "s": 3}, {SOURCE: 9, READER: 4}, {"A1": 0.5, "A2": 1.0})
    merged = ours.aggregate(theirs)
    assert merged.saved_keys == {"a", "b"} and merged.claims == {"r": 6, "s": 3}
    assert merged.prompt_saved == {SOURCE: 9, READER: 4} and merged.reuse_shares == {"A1": 0.5, "A2": 1.0}
