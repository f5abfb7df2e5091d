"""Asynchronous loads (`max_load_tokens_per_step` > 0) run the waiting load with the least work
left first, so a load that reuses most of its rows is not held behind every layer of a dense
prefill queued before it. The engine-level check is in test_async_loads_vllm.py."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from kvbench.contracts import Plan, PlanSegment
from kvbench.methods.connector.loads import LoadJob, next_load, planned_rows
from kvbench.methods.connector.specs import LoadSpec

LAYERS = 4


def _spec(req_id: str, claimed: int, sourced: int, local: int = 0) -> LoadSpec:
    """A load of rows [local, claimed): a shared segment of the first `sourced` rows that an earlier
    turn's cache holds, then the agent's own text."""
    segments = (PlanSegment("ph", "q", 0, sourced, source="t/A0", source_start=0, source_agent="A0"),
                PlanSegment("pf", "tail", sourced, claimed - sourced))
    return LoadSpec(req_id, list(range(claimed + 1)), [], local, claimed, Plan("t", "r", "A1", None, segments))


def _job(spec: LoadSpec) -> LoadJob:
    def work() -> Generator[int, None, dict[str, Any]]:
        yield 0
        return {}

    return LoadJob(spec, work())


def test_planned_rows_are_the_claimed_rows_without_a_source() -> None:
    assert planned_rows(_spec("reuse", 8192, 8000)) == 192
    assert planned_rows(_spec("dense", 8192, 0)) == 8192
    # rows vLLM's prefix cache held are not claimed: neither counted nor subtracted twice
    assert planned_rows(_spec("cached", 8192, 8000, local=100)) == 192
    assert planned_rows(_spec("all-sourced", 512, 512)) == 1  # the load still runs its layers


def test_the_load_with_the_least_work_left_goes_first() -> None:
    dense, reuse = _job(_spec("dense", 8192, 0)), _job(_spec("reuse", 8192, 8000))
    assert next_load([dense, reuse], LAYERS) is reuse  # queued later, but 192 rows per layer against 8192
    assert dense.rows_left(LAYERS) == 8192 * LAYERS and reuse.rows_left(LAYERS) == 192 * LAYERS
    # equal work: the oldest
    first, second = _job(_spec("a", 1024, 0)), _job(_spec("b", 1024, 0))
    assert next_load([first, second], LAYERS) is first


def test_what_a_load_computes_replaces_its_plan_once_a_layer_is_done() -> None:
    """A method may reject a correction and compute a segment its plan names a source for: after its
    first layer the load is as long as that layer says."""
    rejected, other = _job(_spec("rejected", 8192, 8000)), _job(_spec("other", 2048, 0))
    assert next_load([rejected, other], LAYERS) is rejected
    rejected.layers_done, rejected.last_rows = 1, 8192  # the gate sent the query to dense prefill
    assert rejected.rows_left(LAYERS) == 8192 * 3
    assert next_load([rejected, other], LAYERS) is other
    # three of four layers done: little is left, however wide a layer is
    other.layers_done, other.last_rows = 3, 2048
    rejected.layers_done = 3
    assert next_load([rejected, other], LAYERS) is other
