"""What a run starts from: a fresh folder, or an interrupted run's records to keep and the
trajectories still to run (`kvbench replay --resume`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.replay.records import read_journal
from kvbench.replay.run_config import ReplayConfig, ReplayError, check_resumable, new_run_config
from kvbench.tracegen.schema import Trajectory


@dataclass(frozen=True)
class RunStart:
    warmups: list[Trajectory]
    todo: list[Trajectory]  # measured trajectories still to run
    kept: list[dict[str, Any]]  # an earlier segment's records of the trajectories it finished
    dropped: list[str]  # trajectories whose earlier records are void: they run again whole
    run_config: dict[str, Any]


def check_result_dir(result_dir: Path, resume: bool) -> None:
    """A fresh run needs a folder without results, a resumed one the run it finishes: checked
    before any server starts, and again once the run holds the folder's lock."""
    if resume and not (result_dir / run_files.CONFIG).exists():
        raise ReplayError(f"--resume: no earlier run in {result_dir} (no {run_files.CONFIG})")
    if not resume and ((result_dir / run_files.CONFIG).exists() or read_journal(result_dir)):
        raise ReplayError(f"{result_dir} already holds results; pass --resume to finish that run or "
                          "choose another --result-dir (nothing is overwritten)")


def plan_start(cfg: ReplayConfig, uses_connector: bool) -> RunStart:
    """Warm-ups, trajectories still to run, records kept from an earlier run, and the config."""
    result_dir = cfg.output.result_dir
    check_result_dir(result_dir, cfg.output.resume)
    existing = read_journal(result_dir)
    if cfg.output.resume:
        run_config = json.loads((result_dir / run_files.CONFIG).read_text())
        check_resumable(run_config, cfg)
        last = (run_config.get("segments") or [{}])[-1]
        if last.get("status") == "saturated":  # resuming would only queue the same overload again
            raise ReplayError(f"{result_dir}: the run stopped over-saturated ({last.get('saturation', {}).get('at_s', '?')} "
                              "s in): it is over, its figures marked saturated; replay a lower --qps into another folder")
    else:
        run_config = new_run_config(cfg)
    trajectories = cfg.trace.trajectories
    warmups = trajectories[: cfg.load.num_warmups]
    measured = trajectories[cfg.load.num_warmups:]
    if not measured:
        raise ReplayError(f"nothing to measure: {len(trajectories)} trajectories, {cfg.load.num_warmups} warm-ups")
    expected = {t.trajectory_id: len(t.turns) for t in measured}
    by_trajectory: dict[str, list[dict[str, Any]]] = {}
    for record in existing:
        by_trajectory.setdefault(record["trajectory_id"], []).append(record)
    # A trajectory is done when every turn succeeded (and, under a connector method, its stats
    # reached the stats journal: a kill between a request's record and the next stats poll loses
    # them for good, since every run resets the server); others re-run whole (outputs chain).
    journaled: set[str] = set()
    if uses_connector:
        journaled = {e["request_id"] for e in run_files.read_jsonl(result_dir / run_files.METHOD_STATS)
                     if e.get("kind") == "request"}

    def complete(record: dict[str, Any]) -> bool:
        has_stats = not uses_connector or record.get("reused_tokens") is not None or record["request_id"] in journaled
        return bool(record["success"]) and has_stats

    done = {tid for tid, recs in by_trajectory.items()
            if tid in expected and len(recs) == expected[tid] and all(complete(r) for r in recs)}
    return RunStart(warmups=warmups, todo=[t for t in measured if t.trajectory_id not in done],
                    kept=[r for r in existing if r["trajectory_id"] in done],
                    dropped=sorted(set(by_trajectory) - done), run_config=run_config)
