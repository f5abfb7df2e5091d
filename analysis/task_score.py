"""Scoring a run of a task trace (`gen-trace --task recall`): each turn's output against its gold
answer, exact match on the output's first line.

A request that failed, or was never sent, scores as wrong: a method that drops requests does not
get a better accuracy for it. `task_accuracy` is over the trajectories' final turns (the answer
the workflow gives), `task_accuracy_turns` over every turn, `task_accuracy_<agent>` per agent,
`task_accuracy_reuse` over the turns some shared segment of which an earlier turn's cache holds
(what a method serves from reuse), `task_accuracy_first` over the others (the first agents).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.tracegen.schema import Trajectory
from kvbench.tracegen.tasks import answer_of

SCORE_COLUMNS = ["trajectory_id", "turn_id", "agent", "final", "reuse_turn", "position", "gold", "answer", "correct"]


def reuse_turns(trajectory: Trajectory) -> set[str]:
    """Turns with a shared segment that an earlier turn's cache holds: those a method can reuse for."""
    return {t.turn_id for t in trajectory.turns
            if any(s.ph is not None and trajectory.source_of(t, s.ph) is not None for s in t.segments)}


def score_requests(requests: pd.DataFrame, trajectories: Sequence[Trajectory],
                   decode: Callable[[list[int]], str]) -> pd.DataFrame:
    """One row per turn with a gold answer, in the trajectories the run measured (those with at
    least one recorded request)."""
    measured = set(requests["trajectory_id"]) if len(requests) else set()
    outputs = {}
    for row in requests.itertuples(index=False):
        if row.success:
            outputs[(row.trajectory_id, row.turn_id)] = decode(list(row.output_token_ids))
    rows = []
    for trajectory in trajectories:
        if trajectory.task is None or trajectory.trajectory_id not in measured:
            continue
        agents = {t.turn_id: t.agent for t in trajectory.turns}
        reusing = reuse_turns(trajectory)
        for gold in trajectory.task.answers:
            text = outputs.get((trajectory.trajectory_id, gold.turn_id))
            answer = answer_of(text) if text is not None else None
            rows.append({"trajectory_id": trajectory.trajectory_id, "turn_id": gold.turn_id,
                         "agent": agents[gold.turn_id], "final": gold.turn_id == trajectory.task.final_turn,
                         "reuse_turn": gold.turn_id in reusing,
                         "position": gold.position, "gold": gold.answer, "answer": answer,
                         "correct": answer == gold.answer})
    return pd.DataFrame(rows, columns=SCORE_COLUMNS)


def task_figures(scores: pd.DataFrame) -> dict[str, Any]:
    """The summary keys of a scored run."""
    if not len(scores):
        return {}
    figures: dict[str, Any] = {
        "task_accuracy": float(scores.loc[scores["final"], "correct"].mean()),
        "task_accuracy_turns": float(scores["correct"].mean()),
        "task_scored_trajectories": int(scores["trajectory_id"].nunique()),
    }
    if "reuse_turn" in scores:  # task_scores.parquet written before the split have no such column
        for suffix, part in (("reuse", scores[scores["reuse_turn"]]), ("first", scores[~scores["reuse_turn"]])):
            if len(part):
                figures[f"task_accuracy_{suffix}"] = float(part["correct"].mean())
    for agent, group in scores.groupby("agent", sort=True):
        figures[f"task_accuracy_{agent}"] = float(group["correct"].mean())
    return figures


def write_scores(result_dir: Path, trajectories: Sequence[Trajectory], decode: Callable[[list[int]], str]) -> pd.DataFrame:
    """Score the run in `result_dir` into `task_scores.parquet` (the summary picks it up)."""
    requests = pd.read_parquet(result_dir / run_files.REQUESTS)
    scores = score_requests(requests, trajectories, decode)
    scores.to_parquet(result_dir / run_files.TASK_SCORES, index=False)
    return scores


def read_task_figures(result_dir: Path) -> dict[str, Any]:
    path = result_dir / run_files.TASK_SCORES
    return task_figures(pd.read_parquet(path)) if path.exists() else {}
