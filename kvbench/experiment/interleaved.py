"""An interleaved comparison: several arms (each a method's replay of one trace at QPS 0, into a
run folder of its own, against a server of its own) take turns one trajectory at a time in a
rotating order (kvbench.replay.rotation), so that drift on the machine falls on every arm alike
and their turns can be paired per trajectory. Every arm's server is up for the whole comparison;
each run is then scored and summarized as a run of its own. An arm that fails leaves the
rotation; the others finish, and the first failure is raised after every run is summarized."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.experiment.run import require_consent_for, score_and_summarize
from kvbench.experiment.servers import replay_server
from kvbench.replay.interrupts import Interrupted, on_stop_signals
from kvbench.replay.run_config import ReplayConfig, ReplayOutcome
from kvbench.server.config import ServerConfig

logger = logging.getLogger(__name__)

# The noise floor's arm: NonShared replayed a second time, interleaved like the rest, on a server
# of its own. Its ratio to NonShared is what identical methods differ by on this machine now.
AA_ARM = "nonshared-aa"


@dataclass(frozen=True)
class Arm:
    """One arm: its replay (its label names it; its folder holds its run) and the server it starts
    (`server(log_path)`; None: the running servers its config names)."""

    config: ReplayConfig
    server: Callable[[Path], ServerConfig] | None = None

    @property
    def name(self) -> str:
        return self.config.output.label or self.config.output.result_dir.name


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
    interrupted = [e for e in errors if isinstance(e, Interrupted)]
    if interrupted or errors:
        raise (interrupted or errors)[0]
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
