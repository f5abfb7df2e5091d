"""An interleaved comparison: several arms (each a method's replay of one trace at QPS 0, into a
run folder of its own, against a server of its own) take turns one trajectory at a time in a
rotating order (kvbench.replay.rotation), so that drift on the machine falls on every arm alike
and their turns can be paired per trajectory. Every arm's server is up for the whole comparison;
each run is then scored and summarized as a run of its own. An arm that fails leaves the
rotation; the others finish, and the first failure is raised after every run is summarized."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kvbench import run_files
from kvbench.experiment.run import require_consent_for, score_and_summarize
from kvbench.experiment.servers import replay_server
from kvbench.replay.interrupts import Interrupted, on_stop_signals
from kvbench.replay.run_config import ReplayConfig, ReplayOutcome
from kvbench.server.config import ServerConfig

logger = logging.getLogger(__name__)

AA_ARM = run_files.AA_LABEL  # the noise floor's arm, on a server of its own like every arm


@dataclass(frozen=True)
class Arm:
    """One arm: its replay (its label names it; its folder holds its run) and the server it starts
    (`server(log_path)`; None: the running servers its config names)."""

    config: ReplayConfig
    server: Callable[[Path], ServerConfig] | None = None

    @property
    def name(self) -> str:
        return self.config.output.label or self.config.output.result_dir.name


def comparison_arms(arms: Sequence[Arm], interleaved: bool) -> list[Arm]:
    """`arms` marked as one comparison (one id in each run's config.json): a report pairs a run
    only with runs of its own comparison, never with another invocation's."""
    import uuid

    record = {"id": uuid.uuid4().hex[:12], "arms": [arm.name for arm in arms], "interleaved": interleaved}
    marked = []
    for arm in arms:
        given = arm.config.output.extra_config.get(run_files.COMPARISON)  # a sweep's: its own, stable id
        output = dataclasses.replace(arm.config.output, extra_config={
            **arm.config.output.extra_config, run_files.COMPARISON: {**record, **given} if given else record})
        marked.append(dataclasses.replace(arm, config=dataclasses.replace(arm.config, output=output)))
    return marked


def replay_interleaved(arms: Sequence[Arm], announce: Callable[[ServerConfig], Any] = lambda _: None,
                       on_note: Callable[[str], Any] = lambda _: None) -> dict[str, dict[str, Any]]:
    """Replay every arm, taking turns; each run's summary by arm name. Raises the first arm's
    error (Interrupted before any other) once every run that recorded anything is summarized."""
    from kvbench.replay.result_lock import result_dir_lock
    from kvbench.replay.resume import check_result_dir

    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"the arms of an interleaved comparison need distinct labels, got {names}")
    folders = [arm.config.output.result_dir.resolve() for arm in arms]
    if len(set(folders)) != len(folders):
        raise ValueError("the arms of an interleaved comparison need a run folder each")
    for arm in arms:
        require_consent_for(arm.config.trace.trajectories)
    arms = comparison_arms(arms, interleaved=True)
    with contextlib.ExitStack() as stack:
        for arm in arms:  # every folder held, and checked, before a server starts
            stack.enter_context(result_dir_lock(arm.config.output.result_dir, on_note=on_note))
            check_result_dir(arm.config.output.result_dir, arm.config.output.resume)
        bound = []
        for arm in arms:  # the servers up side by side for the whole comparison
            started = None if arm.server is None else arm.server(arm.config.output.result_dir / "server.log")
            bound.append(stack.enter_context(replay_server(arm.config, started, announce=announce)))
        outcomes = asyncio.run(_replay_arms(bound, names))
        summaries: dict[str, dict[str, Any]] = {}
        for name, config, outcome in zip(names, bound, outcomes):
            if not isinstance(outcome, BaseException):
                summaries[name] = score_and_summarize(config)
            elif (config.output.result_dir / run_files.REQUESTS_JOURNAL).exists():
                try:  # a failed or stopped arm is summarized as far as it ran; its own error is raised
                    summaries[name] = score_and_summarize(config)
                except Exception:
                    logger.exception("summarizing the stopped run in %s failed", config.output.result_dir)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    if errors:  # a stop signal before any arm's own failure
        raise next((e for e in errors if isinstance(e, Interrupted)), errors[0])
    return summaries


async def _replay_arms(configs: Sequence[ReplayConfig], names: Sequence[str]) -> list[ReplayOutcome | BaseException]:
    from kvbench.replay.rotation import ArmTurns, Rotation
    from kvbench.replay.runner import Replayer

    rotation = Rotation(list(names))
    replayers = [Replayer(config, ArmTurns(rotation, name)) for config, name in zip(configs, names)]

    def stop(signum: int) -> None:  # one process, one handler: every arm stops
        for replayer in replayers:
            replayer.stop(signum)

    with on_stop_signals(stop):
        return list(await asyncio.gather(*(r.run() for r in replayers), return_exceptions=True))


# A CPU vLLM server's memory beside its KV pool and weights (torch, vLLM, a method's store of
# caches), measured as peak RSS on the 8K quickstart with a 2 GiB pool: NonShared 4.3 GiB,
# FullShared 4.9, KVCMAS 5.1 (reports/2026-12-04-*); a larger store takes more.
SERVER_BASE_GIB = 2.5


def side_by_side_shortfall(servers: int, cpu_kv_cache_gib: float, weights_bytes: int,
                           available_bytes: int | None = None) -> str | None:
    """Why `servers` servers cannot run side by side here (memory), or None when they fit."""
    need = servers * (cpu_kv_cache_gib + weights_bytes / 2**30 + SERVER_BASE_GIB)
    available = (available_bytes if available_bytes is not None else psutil.virtual_memory().available) / 2**30
    if need <= 0.9 * available:
        return None
    return (f"{servers} servers side by side need about {need:.1f} GiB ({cpu_kv_cache_gib:g} GiB KV pool, "
            f"{weights_bytes / 2**30:.2f} GiB weights and about {SERVER_BASE_GIB:g} GiB of their own each); "
            f"{available:.1f} GiB are available")


def weights_bytes(model_path: str) -> int:
    """The size of a local model's weight files (0 for a hub name: unknown until downloaded)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
