"""Scoring a run of a task trace (`gen-trace --task NAME`): each turn's output against its gold
answer, read and graded by the task's own module (kvbench.tracegen.tasks; this module reads the
run's recorded files and the trace, and looks the task up by name).

A request that failed, or was never sent, scores as wrong: a method that drops requests does not
get a better accuracy for it. `task_accuracy` is over the trajectories' final turns (the answer
the workflow gives), `task_accuracy_turns` over every turn, `task_accuracy_<agent>` per agent,
`task_accuracy_reuse` over the turns some shared segment of which an earlier turn's cache holds
(what a method serves from reuse), `task_accuracy_first` over the others (the first agents);
`task_unparseable` counts final answers the task could not read (benchmark tasks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from kvbench import run_files
from kvbench.tracegen.schema import Trajectory
from kvbench.tracegen.tasks.base import Score, ScoredTurn
from kvbench.tracegen.tasks.registry import get_task

# `item_id`, `parsed` (how the task read the answer) and `detail` (what grading said: HumanEval's
# harness result) are filled for benchmark tasks.
SCORE_COLUMNS = ["trajectory_id", "turn_id", "agent", "final", "reuse_turn", "position", "gold", "answer", "correct",
                 "item_id", "parsed", "detail"]


class Decoder(Protocol):
    """What decodes a run's output token ids (kvbench.tracegen.tokenizer.TraceTokenizer)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


def reuse_turns(trajectory: Trajectory) -> set[str]:
    """Turns with a shared segment that an earlier turn's cache holds: those a method can reuse for."""
    return {t.turn_id for t in trajectory.turns
            if any(s.ph is not None and trajectory.source_of(t, s.ph) is not None for s in t.segments)}


def score_requests(requests: pd.DataFrame, trajectories: Sequence[Trajectory],
                   decode: Callable[[list[int]], str],
                   decode_text: Callable[[list[int]], str] | None = None) -> pd.DataFrame:
    """One row per turn with a gold answer, in the trajectories the run measured (those with at
    least one recorded request). `decode_text` reads the outputs of tasks that read text (without
    special tokens)."""
    measured = set(requests["trajectory_id"]) if len(requests) else set()
    outputs = {}
    for row in requests.itertuples(index=False):
        if row.success:
            outputs[(row.trajectory_id, row.turn_id)] = list(row.output_token_ids)
    rows: list[dict[str, Any]] = []
    scored: dict[str, list[tuple[int, ScoredTurn]]] = {}
    for trajectory in trajectories:
        if trajectory.task is None or trajectory.trajectory_id not in measured:
            continue
        task = get_task(trajectory.task.name)
        agents = {t.turn_id: t.agent for t in trajectory.turns}
        reusing = reuse_turns(trajectory)
        for gold in trajectory.task.answers:
            ids = outputs.get((trajectory.trajectory_id, gold.turn_id))
            score = Score(answer=None, correct=False, detail="no output (the request failed or was not sent)")
            if ids is not None:
                score = task.score((decode_text or decode)(ids) if task.reads_text else decode(ids), gold, trajectory)
                scored.setdefault(task.name, []).append((len(rows), ScoredTurn(score, gold, trajectory)))
            rows.append({"trajectory_id": trajectory.trajectory_id, "turn_id": gold.turn_id,
                         "agent": agents[gold.turn_id], "final": gold.turn_id == trajectory.task.final_turn,
                         "reuse_turn": gold.turn_id in reusing, "position": gold.position, "gold": gold.answer,
                         "item_id": trajectory.task.item_id, "score": score})
    for name, turns in scored.items():
        get_task(name).grade([turn for _, turn in turns])
    for row in rows:
        score = row.pop("score")
        row.update(answer=score.answer, correct=score.correct, parsed=score.parsed, detail=score.detail)
    return pd.DataFrame(rows, columns=SCORE_COLUMNS)


def task_figures(scores: pd.DataFrame) -> dict[str, Any]:
    """The summary keys of a scored run."""
    if not len(scores):
        return {}
    figures: dict[str, Any] = {
        "task_accuracy": float(scores.loc[scores["final"], "correct"].mean()),
        **({"task_unparseable": int((scores["final"] & (scores["parsed"] == "none")).sum())}
           if "parsed" in scores and scores["parsed"].notna().any() else {}),
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


def write_scores(result_dir: Path, trajectories: Sequence[Trajectory], tokenizer: Decoder) -> pd.DataFrame:
    """Score the run in `result_dir` into `task_scores.parquet` (the summary picks it up)."""
    requests = run_files.load_requests(result_dir).frame
    scores = score_requests(requests, trajectories, tokenizer.decode,
                            lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    scores.to_parquet(result_dir / run_files.TASK_SCORES, index=False)
    return scores


def read_task_figures(result_dir: Path) -> dict[str, Any]:
    path = result_dir / run_files.TASK_SCORES
    return task_figures(pd.read_parquet(path)) if path.exists() else {}
