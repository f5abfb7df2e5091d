"""Running loads on the worker: one interface, a synchronous and an asynchronous implementation.

A load is a generator that materializes one request's cache one partial-forward layer at a time
(it yields the rows each layer computed and returns the load's stats). Any exception inside it
becomes a dense fallback: vLLM recomputes what the load would have written, so a load never
leaves wrong K/V behind. The two implementations differ only in when layers run and in how a
failure is handed back to vLLM.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field

from kvbench.contracts import LoadStats
from kvbench.methods.connector.specs import LoadSpec

logger = logging.getLogger("kvbench.connector")

LoadWork = Generator[int, None, LoadStats]


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
    work: LoadWork
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
        return self.spec.key

    def rows_left(self, layers: int) -> int:
        """Rows it still has to put through a layer: the rows of its last layer (its plan's before
        the first) times the layers left."""
        per_layer = planned_rows(self.spec) if self.last_rows is None else self.last_rows
        return max(1, per_layer) * max(1, layers - self.layers_done)

    def finished_stats(self, stats: LoadStats) -> LoadStats:
        """The load's own stats plus where and how long it ran."""
        spec = self.spec
        stats.update({"load_s": time.perf_counter() - self.started, "turn": spec.plan.turn, "agent": spec.plan.agent,
                      "local_tokens": spec.num_local, "claimed_tokens": spec.num_target - spec.num_local,
                      "source_wait_s": spec.source_wait_s,
                      **({"decide_wait_s": spec.decide_wait_s} if spec.decide_wait_s is not None else {}),
                      "load_steps": self.steps, "load_step_batches": self.step_batches,
                      "load_step_offsets_s": self.step_offsets_s})
        return stats


def next_load(queue: Iterable[LoadJob], layers: int) -> LoadJob:
    """The waiting load with the fewest rows left (the oldest of equals). A load that reuses most
    of its rows then ends in the next step rather than after every layer of a dense prefill queued
    before it: shortest remaining work first, which minimizes the mean wait."""
    return min(queue, key=lambda job: job.rows_left(layers))


class Loads:
    """Runs loads; `step` is called once per engine step with the loads it brings."""

    def __init__(self, work: Callable[[LoadSpec], LoadWork], done: Callable[[LoadJob, LoadStats], None],
                 block_size: int) -> None:
        self._work, self._done, self.block_size = work, done, block_size
        self._finished: set[str] = set()  # asynchronous loads that ended (vLLM may schedule them)
        self._failed: set[str] = set()  # asynchronous loads that failed (vLLM recomputes them)
        self._failed_blocks: set[int] = set()  # blocks of failed synchronous loads

    def step(self, specs: list[LoadSpec], scheduled: frozenset[str], layers: int) -> None:
        raise NotImplementedError

    def take_finished(self) -> set[str]:
        done, self._finished = self._finished, set()
        return done

    def take_failed(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _fail(self, spec: LoadSpec) -> None:
        """Hand a failed load back to vLLM, which then computes its rows itself."""
        raise NotImplementedError

    def _run(self, job: LoadJob, budget: int | None, scheduled: frozenset[str]) -> tuple[LoadStats | None, int]:
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
        except Exception as exc:  # any failure falls back to vLLM's own prefill
            logger.exception("kvbench: load of %s failed; vLLM recomputes it densely", job.key)
            spec = job.spec
            self._fail(spec)
            return {"fallback": "dense", "error": f"{type(exc).__name__}: {exc}",
                    "reused_tokens": 0, "recomputed_tokens": spec.num_target - spec.num_local}, spent


class SyncLoads(Loads):
    """vLLM's synchronous load: each load ends in the engine step that schedules its request,
    before the forward."""

    def step(self, specs: list[LoadSpec], scheduled: frozenset[str], layers: int) -> None:
        for spec in specs:
            job = LoadJob(spec, self._work(spec))
            stats, _ = self._run(job, None, scheduled)
            assert stats is not None, "a load without a budget runs to its end"
            self._done(job, stats)

    def _fail(self, spec: LoadSpec) -> None:
        self._failed_blocks.update(spec.block_ids[spec.num_local // self.block_size:])


class AsyncLoads(Loads):
    """Asynchronous loads: each engine step runs layers of the waiting loads, the one with the
    least work left first, until `tokens_per_step` tokens' worth of rows went through every layer
    (at least one layer); the requests wait unscheduled until their load ends."""

    def __init__(self, work: Callable[[LoadSpec], LoadWork], done: Callable[[LoadJob, LoadStats], None],
                 block_size: int, tokens_per_step: int) -> None:
        super().__init__(work, done, block_size)
        self.tokens_per_step = tokens_per_step
        self.queue: deque[LoadJob] = deque()

    def step(self, specs: list[LoadSpec], scheduled: frozenset[str], layers: int) -> None:
        self.queue.extend(LoadJob(spec, self._work(spec)) for spec in specs)
        spent, budget = 0, self.tokens_per_step * layers  # in rows through one layer
        while self.queue and (spent < budget or spent == 0):
            job = next_load(self.queue, layers)
            stats, rows = self._run(job, budget - spent, scheduled)
            spent += max(rows, 1)
            if stats is None:
                return
            self.queue.remove(job)
            self._done(job, stats)
            self._finished.add(job.spec.req_id)

    def _fail(self, spec: LoadSpec) -> None:
        self._failed.add(spec.req_id)  # vLLM recomputes the whole request


def make_loads(work: Callable[[LoadSpec], LoadWork], done: Callable[[LoadJob, LoadStats], None], block_size: int,
               tokens_per_step: int) -> Loads:
    """Synchronous loads for a zero budget, asynchronous ones otherwise."""
    if tokens_per_step > 0:
        return AsyncLoads(work, done, block_size, tokens_per_step)
    return SyncLoads(work, done, block_size)
