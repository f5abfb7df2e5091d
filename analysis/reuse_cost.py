"""What reuse costs, turn by turn: each run's reuse turns (turns some earlier cache could serve)
against its reference (`replay --reference`, a sweep's `--quality`): task accuracy where the answer
is known, exact match, token F1, first-token KL and where outputs first diverge, each mean with a
95% bootstrap interval over trajectories. NonShared's own row is the noise floor: a gap inside
its interval is no finding."""

from __future__ import annotations

import math

import pandas as pd

from kvbench import run_files
from kvbench.analysis.intervals import cluster_mean_interval
from kvbench.analysis.runs import Run

COLUMNS = ["run", "reuse_turns", "task_accuracy_reuse", "exact_match_reuse", "token_f1_reuse", "first_token_kl_reuse",
           "diverged_reuse_turns", "p50_first_divergence"]


def _read(run: Run, name: str) -> pd.DataFrame | None:
    path = run.path / name
    return pd.read_parquet(path) if path.exists() else None


def _mean(frame: pd.DataFrame | None, column: str, digits: int = 2) -> str:
    """`mean [low, high]` over the reuse turns holding a value, or "" where none does."""
    if frame is None or column not in frame or not frame[column].notna().any():
        return ""
    values = frame[column].astype(float)
    low, high = cluster_mean_interval(values, frame["trajectory_id"])
    return f"{values.mean():.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def reuse_turn_costs(runs: list[Run]) -> pd.DataFrame:
    """One row per run that compared its outputs with a reference or scored a task; empty when none did."""
    rows = []
    for run in runs:
        if run.is_floor or run.is_quality_baseline:
            continue
        quality, scores = _read(run, run_files.QUALITY), _read(run, run_files.TASK_SCORES)
        quality = quality[quality["reuse_turn"] & quality["success"]] if quality is not None else None
        scores = scores[scores["reuse_turn"]] if scores is not None and "reuse_turn" in scores else None
        if (quality is None or not len(quality)) and (scores is None or not len(scores)):
            continue
        diverged = quality[~quality["exact_match"].astype(bool)] if quality is not None else None
        if scores is not None:
            scores = scores.assign(correct=scores["correct"].astype(float))
        rows.append({
            "run": run.cell,
            "reuse_turns": len(quality) if quality is not None else len(scores) if scores is not None else 0,
            "task_accuracy_reuse": _mean(scores, "correct"),
            "exact_match_reuse": _mean(quality.assign(exact_match=quality["exact_match"].astype(float))
                                       if quality is not None else None, "exact_match"),
            "token_f1_reuse": _mean(quality, "token_f1"),
            "first_token_kl_reuse": _mean(quality, "first_token_kl", 3),
            "diverged_reuse_turns": len(diverged) if diverged is not None else "",
            "p50_first_divergence": (float(diverged["first_divergence"].median())
                                     if diverged is not None and len(diverged) else math.nan),
        })
    return pd.DataFrame(rows, columns=COLUMNS)
