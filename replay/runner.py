"""The replay loop: schedule trajectories, run each one's turns as their inputs become known,
and record every request."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import signal
import time
from typing import Any

import aiohttp

from kvbench import run_files
from kvbench.replay.backend import CompletionsBackend
from kvbench.replay.interrupts import Interrupted, on_stop_signals
from kvbench.replay.method_stats import STATS_FIELDS, MethodStatsCollector
from kvbench.replay.progress import ReplayProgress
from kvbench.replay.prompts import PromptBuilder, TurnPrompt
from kvbench.replay.records import RequestRecord, ResultsWriter, write_failure
from kvbench.replay.result_lock import result_dir_lock
from kvbench.replay.resume import RunStart, plan_start
from kvbench.replay.rotation import ArmTurns, Phase, run_steps
from kvbench.replay.routing import Router
from kvbench.replay.run_config import ReplayConfig, ReplayError, ReplayOutcome
from kvbench.replay.saturation import SaturationVerdict, SaturationWatch
from kvbench.replay.schedule import EARLY_START_S, arrival_offsets, sleep_until
from kvbench.replay.server_metrics import MetricsSampler
from kvbench.replay.servers import ReplayServers, unreachable_reason
from kvbench.run_files import append_segment, write_text_atomic
from kvbench.server.errors import ServerError
from kvbench.tracegen.schema import Trajectory, Turn

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # how often the serving time and the method's stats reach the disk
FINAL_POLL_TIMEOUT_S = 60.0


class Replayer:
    def __init__(self, config: ReplayConfig, turns: ArmTurns | None = None) -> None:
        """`turns`: its arm of an interleaved comparison (replay/rotation.py); None: a run of its own."""
        self.config = config
        self.turns = turns
        self.positions = {t.trajectory_id: i for i, t in enumerate(config.trace.trajectories)}  # place in the trace
        self.method_info = config.method.spec  # its flags only: the client imports no method
        self.abort_reason: str | None = None
        self.interrupted: int | None = None  # the stop signal that ended the run
        self.writer: ResultsWriter | None = None  # set once the run reached its servers
        self.stats: MethodStatsCollector | None = None
        self.segment: dict[str, Any] = {}
        self.semaphore = asyncio.Semaphore(config.load.max_concurrency) if config.load.max_concurrency else None
        self.t0_ns = 0
        self._consecutive_unreachable = 0
        self.servers = ReplayServers(config.servers.base_urls, config.method.name, self.method_info.uses_connector)
        self.router = Router(config.servers.base_urls, config.load.routing)
        self.backend = CompletionsBackend(  # models: filled when the servers are checked
            self.servers.served_models, config.quality.sampling, config.quality.logprobs,
            config.load.request_timeout_s, config.quality.first_token_only)
        self.progress = ReplayProgress(config.method.name, 0, enabled=False)
        # Loaded runs only: a single stream cannot outrun its server.
        loaded = config.load.qps > 0 or config.load.use_trace_timestamps
        self.saturation = SaturationWatch(config.load.saturation if loaded else None)
        self._launch: asyncio.Task[None] | None = None  # the trajectories' scheduling: cancelled on saturation
        self._body: asyncio.Task[None] | None = None  # the run's own work, cancelled by a stop signal
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the run -----------------------------------------------------------------------------
    async def run(self) -> ReplayOutcome:
        """The run, or the rest of an interrupted one. SIGINT/SIGTERM stop it cleanly: requests in
        flight are recorded as interrupted, the run's files are closed, then `Interrupted` is raised."""
        try:
            return await self._run()
        finally:
            if self.turns is not None:  # however it ends, the other arms go on without it
                await self.turns.leave()

    async def _run(self) -> ReplayOutcome:
        cfg = self.config
        start = plan_start(cfg, self.method_info.uses_connector)
        run_config = start.run_config
        offsets = arrival_offsets(cfg.load, start.todo)  # refused before anything is sent or written
        if self.turns is not None:
            if cfg.load.qps > 0 or cfg.load.use_trace_timestamps:
                raise ReplayError("arms take turns one trajectory at a time: an interleaved comparison runs at --qps 0")
            await self.turns.register(run_steps(len(start.warmups), [self.positions[t.trajectory_id] for t in start.todo],
                                                primed=cfg.load.prime_method_state))
        segment = len(run_config["segments"])
        builder = PromptBuilder(cfg.tokenizer, cfg.trace.header.prompt_prefix_ids,
                                run_id=f"{run_config['run_id']}/s{segment}",
                                reference_outputs=cfg.quality.reference.outputs if cfg.quality.reference is not None else None,
                                drop_shared=cfg.quality.drop_shared,
                                keep_unread_caches=cfg.quality.save_prompt_ids, concurrent_sources=cfg.load.concurrent_sources)
        sampler = MetricsSampler(cfg.servers.sampled_urls, cfg.servers.pids, cfg.servers.found_pids(), paused=self._idle)
        if self.method_info.uses_connector:
            self.stats = MethodStatsCollector(cfg.output.result_dir, cfg.servers.base_urls, self.servers.fetch_stats)
        self._loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False)) as session:
            body = self._body = asyncio.create_task(self._run_body(session, start, offsets, builder, sampler))
            if self.interrupted is not None:  # stopped while it prepared
                body.cancel()
            # Arms of an interleaved comparison share one process: its runner takes the signals.
            with on_stop_signals(self.stop) if self.turns is None else contextlib.nullcontext():
                try:
                    await body
                except asyncio.CancelledError:
                    if self.interrupted is None or not body.cancelled():
                        raise
                finally:
                    if self.writer is not None:  # the run reached its servers: it exists on disk
                        await self._finish_segment(session, run_config, sampler, segment)
        if self.writer is None:  # stopped before the run reached its servers: nothing on disk
            assert self.interrupted is not None
            raise Interrupted(self.interrupted)
        completed = sum(bool(r["success"]) for r in self.writer.records)
        outcome = ReplayOutcome(cfg.output.result_dir, completed, len(self.writer.records) - completed)
        if self.interrupted is not None:
            raise Interrupted(self.interrupted)
        if self.abort_reason:
            raise ReplayError(f"run aborted: {self.abort_reason}. {outcome.completed} requests completed and "
                              f"{outcome.failed} failed are saved in {cfg.output.result_dir}; finish it with --resume")
        return outcome

    def stop(self, signum: int) -> None:
        """SIGINT/SIGTERM: stop cleanly (in-flight requests recorded interrupted); a second: at once."""
        if self.interrupted is not None:
            raise Interrupted(signum)
        self.interrupted = signum
        if self._body is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._body.cancel)

    async def _run_body(self, session: aiohttp.ClientSession, start: RunStart, offsets: list[float],
                        builder: PromptBuilder, sampler: MetricsSampler) -> None:
        cfg = self.config
        warmups, todo, kept, run_config = start.warmups, start.todo, start.kept, start.run_config
        run_config.update(await self.servers.check(session), server_pids=cfg.servers.pids)
        self.servers.refuse_unservable(cfg.trace)  # before anything is sent
        builder.shared_tier = self.servers.shared_tier  # sources on other servers are readable there
        # Only now does the run exist on disk: one that never reached a server leaves nothing
        # that would make the same command refuse to run again.
        try:
            self.writer = ResultsWriter(cfg.output.result_dir, kept, start.dropped)
        except OSError as exc:
            raise ReplayError(write_failure(self.config.output.result_dir, exc, kept)) from None
        if self.stats is not None:
            self.stats.load({r["request_id"] for r in kept})
        self.segment = {"started": time.time(), "duration_s": 0.0, "trajectories": len(todo), "status": "warm-up",
                        "aborted": None}
        run_config["segments"].append(self.segment)
        self._write_config(run_config)
        prime = bool(warmups) and cfg.load.prime_method_state
        if prime:  # what the warm-ups teach the method, and nothing from earlier runs
            async with self._turn("prepare"):
                await self.servers.reset(session)
        if warmups:
            await self._warm_up(session, warmups, builder)
        # Every run starts cold (design: caches are reset between runs), after the warm-ups:
        # they warm kernels and leave no prefix-cache blocks; method state only when asked.
        async with self._turn("reset"):
            await self.servers.reset(session, keep_method_state=prime)
        if warmups:  # what the warm-ups cost (a method's anchor building in them included)
            self.segment.update(warmup_s=round(time.time() - self.segment["started"], 3), warmup_trajectories=len(warmups))
        await sampler.start(session)
        stats = self.stats
        self.progress = ReplayProgress(cfg.method.name, sum(len(t.turns) for t in todo), enabled=cfg.output.show_progress,
                                       prefix_hit_share=sampler.prefix_cache_hit_share,
                                       reused_tokens=stats.reused_tokens if stats is not None else lambda: None)
        self.progress.start()
        self.t0_ns = time.perf_counter_ns()
        self.segment["status"] = "running"
        stop_heartbeat = asyncio.Event()
        heartbeat = asyncio.create_task(self._heartbeat(run_config, len(run_config["segments"]) - 1, stop_heartbeat))
        gc.disable()  # collector pauses would show up as client-side latency
        try:
            await self._run_all(session, todo, offsets, builder, self.writer)
        finally:
            gc.enable()
            stop_heartbeat.set()  # not cancelled: a poll in progress must land in the journal
            await heartbeat

    async def _heartbeat(self, run_config: dict[str, Any], segment: int, stop: asyncio.Event) -> None:
        """Every few seconds: the segment's serving time into config.json (a resumed run adds it
        up even if this process is killed) and the method's stats into their journal."""
        warned = False
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), HEARTBEAT_S)
            self.segment["duration_s"] = self._active_s()
            self._write_config(run_config)
            if self.stats is not None and not stop.is_set() and not self._idle():
                try:
                    await self.stats.poll(segment, self.segment["duration_s"])
                except ServerError as exc:
                    if not warned:
                        logger.warning("collecting method stats failed (retried every %gs): %s", HEARTBEAT_S, exc)
                    warned = True
                except OSError as exc:  # its journal cannot be written: the run ends
                    self._abort_on_write_failure(exc)

    async def _finish_segment(self, session: aiohttp.ClientSession, run_config: dict[str, Any],
                              sampler: MetricsSampler, segment: int) -> None:
        """Close the segment however it ended: its time, the last stats, the files. A file that
        cannot be written (a full disk) ends the run as aborted, what was written kept whole."""
        writer = self.writer
        assert writer is not None
        self.progress.stop()
        if self.t0_ns:
            self.segment["duration_s"] = self._active_s()
            await sampler.stop(session)
        try:
            if self.stats is not None:
                if self.abort_reason is None:
                    try:
                        await asyncio.wait_for(self.stats.poll(segment, self.segment["duration_s"]), FINAL_POLL_TIMEOUT_S)
                    except (TimeoutError, ServerError) as exc:
                        logger.warning("the last method-stats poll failed: %s", exc)
                # successful requests whose stats never came (their server died before reporting)
                stats_before = [r.get("method_stats") for r in writer.records]
                self.segment["method_stats_missing"] = self.stats.apply(writer.records)
                if writer.failure is None:
                    writer.update([r for r, before in zip(writer.records, stats_before) if r.get("method_stats") != before],
                                  STATS_FIELDS)
            writer.close()
            append_segment(self.config.output.result_dir / run_files.SERVER_METRICS, sampler.samples, segment)
            append_segment(self.config.output.result_dir / run_files.MACHINE_LOAD, sampler.machine.samples, segment)
        except OSError as exc:
            self._abort_on_write_failure(exc)
            with contextlib.suppress(OSError):
                writer.close()
        self.segment["aborted"] = self.abort_reason
        self.segment["status"] = (f"interrupted by {signal.Signals(self.interrupted).name}" if self.interrupted
                                  else "aborted" if self.abort_reason else
                                  "saturated" if self.saturated is not None else "finished")
        self._write_config(run_config)

    def _abort_on_write_failure(self, exc: OSError) -> None:
        """The first failed write ends the run (a later one says nothing new)."""
        if self.abort_reason is None:
            self.abort_reason = write_failure(self.config.output.result_dir, exc, self.writer.records if self.writer else [])

    def _write_config(self, run_config: dict[str, Any]) -> None:
        """config.json rewritten; when it cannot be (a full disk), the one on disk stays, and the run ends."""
        if self.turns is not None:  # its place in each measured trajectory's order, so far
            run_config["interleaved"] = self.turns.describe()
        try:
            write_text_atomic(self.config.output.result_dir / run_files.CONFIG, json.dumps(run_config, indent=2) + "\n")
        except OSError as exc:
            self._abort_on_write_failure(exc)

    async def _warm_up(self, session: aiohttp.ClientSession, warmups: list[Trajectory],
                       builder: PromptBuilder) -> None:
        for index, trajectory in enumerate(warmups):  # single stream, not recorded; routed as the run is
            async with self._turn("warmup", index):
                await self._run_trajectory(session, trajectory, index, 0, builder, writer=None)

    # -- interleaved runs (replay/rotation.py) ---------------------------------------------------
    def _turn(self, phase: Phase, position: int = 0) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext() if self.turns is None else self.turns.turn(phase, position)

    def _idle(self) -> bool:
        """Another arm holds the turn: this run leaves its servers alone (ArmTurns.idle)."""
        return self.turns is not None and self.turns.idle()

    def _active_s(self) -> float:
        """The run's serving time: since its first measured request, or, taking turns with other
        arms, only the time it held the turn measuring (the others' turns are not its time)."""
        if self.turns is not None:
            return self.turns.busy_s()
        return (time.perf_counter_ns() - self.t0_ns) / 1e9

    async def _run_all(self, session: aiohttp.ClientSession, trajectories: list[Trajectory], offsets: list[float],
                       builder: PromptBuilder, writer: ResultsWriter) -> None:
        """Every trajectory at its arrival; an over-saturated run stops there (its requests in
        flight recorded as stopped), a stop signal as before."""
        self._launch = asyncio.create_task(self._launch_all(session, trajectories, offsets, builder, writer))
        try:
            await self._launch
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.saturated is None or (task is not None and task.cancelling()):
                raise  # a stop signal: the run's own cancellation
            logger.warning("kvbench: %s; the run stops (its figures are marked saturated)", self.saturated.describe())

    async def _launch_all(self, session: aiohttp.ClientSession, trajectories: list[Trajectory], offsets: list[float],
                          builder: PromptBuilder, writer: ResultsWriter) -> None:
        single_stream = self.config.load.qps == 0 and not self.config.load.use_trace_timestamps
        tasks: list[asyncio.Task[None]] = []
        try:
            for index, (trajectory, offset) in enumerate(zip(trajectories, offsets)):
                if self._should_stop():
                    break
                if single_stream:
                    async with self._turn("measure", self.positions[trajectory.trajectory_id]):
                        await self._run_trajectory(session, trajectory, index, time.perf_counter_ns(), builder, writer)
                    continue
                target_ns = self.t0_ns + int(offset * 1e9)
                # Start the task early: it builds its first prompts, then waits for the exact time.
                delay = (target_ns - time.perf_counter_ns()) / 1e9 - EARLY_START_S
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(
                    self._run_trajectory(session, trajectory, index, target_ns, builder, writer)))
            if tasks:
                await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # stopped: the trajectories in flight record what they had sent
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    @property
    def saturated(self) -> SaturationVerdict | None:
        return self.saturation.verdict

    def _should_stop(self) -> bool:
        if self.abort_reason is None:
            self.abort_reason = self.config.servers.failure()
        return self.abort_reason is not None or self.saturated is not None

    async def _run_trajectory(self, session: aiohttp.ClientSession, trajectory: Trajectory, index: int,
                              arrival_ns: int, builder: PromptBuilder, writer: ResultsWriter | None) -> None:
        """The `index`-th trajectory's turns, each sent when ready to the server routing picks."""
        loop = asyncio.get_running_loop()
        finished: dict[str, asyncio.Future[bool]] = {t.turn_id: loop.create_future() for t in trajectory.turns}
        outputs: dict[str, list[int]] = {}
        prompts: dict[str, TurnPrompt] = {}  # finished turns'
        started: dict[str, TurnPrompt] = {}  # turns sent (a concurrent turn may read their prompt)
        placed: dict[str, str] = {}  # the server of each turn sent

        async def run_turn(turn: Turn) -> None:
            ok = True
            for dep in turn.after:
                ok = await finished[dep] and ok
            ready_ns = arrival_ns if not turn.after else time.perf_counter_ns()
            try:
                if self._should_stop():
                    return  # not started: no record, --resume runs it
                url = placed[turn.turn_id] = self.router.route(index, trajectory, turn, placed)
                record = RequestRecord(
                    run_id=builder.run_id, method=self.config.method.name, trajectory_id=trajectory.trajectory_id,
                    turn_id=turn.turn_id, agent=turn.agent, edge_source=",".join(turn.after) or None,
                    server_url=url, request_id=f"{builder.run_id}/{trajectory.trajectory_id}/{turn.turn_id}",
                    prompt_tokens=trajectory.prompt_tokens(turn),
                    shared_tokens=sum(trajectory.segment_tokens(s, turn) for s in turn.segments if s.ph),
                    reusable_tokens=sum(trajectory.segment_tokens(s, turn) for s in turn.segments
                                        if s.ph and trajectory.source_of(turn, s.ph)),
                    scheduled_ns=ready_ns - self.t0_ns,
                )
                if not ok:
                    record.error_type, record.error_message = "dependency_failed", "an upstream turn failed"
                    self._record(record, writer)
                    return
                prompt = builder.build(trajectory, turn, outputs, prompts, started,
                                       placed if len(self.router.urls) > 1 else None)
                started[turn.turn_id] = prompt  # (before any wait: turns started together read in trace order)
                record.prompt_tokens = len(prompt.token_ids)  # real outputs may differ from max_tokens
                record.reusable_tokens = prompt.reusable_tokens
                if not turn.after:
                    await sleep_until(arrival_ns)
                with self.router.sending(url):
                    ok = await self._send(session, url, turn, prompt, record, writer, outputs)
                prompts[turn.turn_id] = prompt
            finally:
                if not finished[turn.turn_id].done():
                    finished[turn.turn_id].set_result(ok and turn.turn_id in outputs)

        self.saturation.started += 1
        try:
            await asyncio.gather(*(run_turn(t) for t in trajectory.turns))
        finally:
            self.saturation.ended += 1

    async def _send(self, session: aiohttp.ClientSession, url: str, turn: Turn, prompt: TurnPrompt,
                    record: RequestRecord, writer: ResultsWriter | None, outputs: dict[str, list[int]]) -> bool:
        salted = self.method_info.approximate and record.reusable_tokens
        body = self.backend.body(url, prompt.token_ids, turn.max_tokens, prompt.plan.to_params(),
                                 record.request_id if salted else None, ignore_eos=not turn.stop_at_eos,
                                 adapter=prompt.plan.adapter)
        queued_ns = time.perf_counter_ns()
        try:
            async with self.semaphore if self.semaphore is not None else contextlib.nullcontext():
                result = await self.backend.send(session, url, body, record.request_id)
        except asyncio.CancelledError:  # the run was stopped with this request in flight
            record.sent_ns, record.end_ns = queued_ns - self.t0_ns, time.perf_counter_ns() - self.t0_ns
            if self.saturated is not None and not self.interrupted:
                record.error_type = run_files.SATURATION_STOP
                record.error_message = f"the run stopped before the answer ended: {self.saturated.describe()}"
            else:
                why = f"by {signal.Signals(self.interrupted).name}" if self.interrupted else "by cancellation"
                record.error_type = "interrupted"
                record.error_message = f"the run was stopped {why} before the answer ended"
            self._record(record, writer)
            raise
        output_ids = (result.output_token_ids or self.config.tokenizer.encode(result.output_text)) \
            if result.success else []
        record.take_result(result, self.t0_ns, queued_ns, output_ids)
        if result.success:
            record.generated_text = self.config.tokenizer.decode(output_ids)
        if self.config.quality.save_prompt_ids:
            record.prompt_token_ids = result.prompt_token_ids if result.prompt_token_ids is not None else prompt.token_ids
        if not self.method_info.uses_connector:  # plain vLLM: all of what it calls cached is its prefix cache
            record.prefix_cached_tokens = record.cached_tokens
        if result.success:
            outputs[turn.turn_id] = list(output_ids)  # (later prompts take its message: PromptBuilder)
            self._consecutive_unreachable = 0
        elif result.error_type == "connection_refused":
            self._consecutive_unreachable += 1
            if self._consecutive_unreachable >= 3 and self.abort_reason is None:
                self.abort_reason = await unreachable_reason(self.config.servers.failure, url, result.error_message)
        self._record(record, writer)
        return result.success

    # -- output --------------------------------------------------------------------------------
    def _record(self, record: RequestRecord, writer: ResultsWriter | None) -> None:
        if writer is None:
            return
        try:
            writer.add(record)
        except OSError as exc:  # the request re-runs on --resume: its trajectory is incomplete
            self._abort_on_write_failure(exc)
            return
        self.progress.add(record.success, record.ttft_ms, record.shared_tokens)
        if record.success and (verdict := self.saturation.finished(record.end_ns / 1e9, record.ttft_ms)) is not None:
            self.segment["saturation"] = verdict.to_dict()
            if self._launch is not None:
                self._launch.cancel()  # no new work; what is in flight is recorded as stopped


def run_replay(config: ReplayConfig) -> ReplayOutcome:
    """Replay `config.trace` and record it in `config.output.result_dir`, holding the folder's lock
    throughout; raises ReplayError (aborted), ResultDirError (the folder is another run's or
    cannot be written), Interrupted (a stop signal) or ServerError after closing whatever the
    run had written."""
    with result_dir_lock(config.output.result_dir, on_note=logger.warning):
        return asyncio.run(Replayer(config).run())
