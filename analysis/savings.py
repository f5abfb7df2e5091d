"""What reuse saves, turn by turn: each method's reuse turns (turns some earlier cache could serve)
and first turns (turns that reuse nothing) against NonShared's same turns of the same workload,
as p50 TTFT ratios with a 95% bootstrap interval over trajectories. A ratio whose interval holds
1 is no finding."""

from __future__ import annotations

import math

import pandas as pd

from kvbench.analysis.intervals import p50_ratio_interval
from kvbench.analysis.runs import Run

COLUMNS = ["run", "reuse_turns", "p50_reuse_ttft_ms", "reuse_vs_nonshared", "reuse_vs_fullshared",
           "p50_first_ttft_ms", "first_vs_nonshared"]


def _turns(run: Run, reuse: bool) -> pd.DataFrame:
    requests = run.requests
    reusable = requests["reusable_tokens"].fillna(0) > 0
    return requests[reusable if reuse else ~reusable]


def _ratio(numerator: pd.DataFrame, denominator: pd.DataFrame) -> str:
    """`r [low, high]`, or the reason there is none."""
    try:
        interval = p50_ratio_interval(numerator, denominator)
    except ValueError:  # fewer than two trajectories on a side
        return "n/a (fewer than 2 trajectories)"
    if math.isnan(interval.ratio):
        return "n/a"
    return f"{interval.ratio:.2f} [{interval.low:.2f}, {interval.high:.2f}]"


def _p50(turns: pd.DataFrame) -> float:
    ttft = turns.loc[turns["success"], "ttft_ms"].dropna()
    return float(ttft.median()) if len(ttft) else math.nan


def reuse_turn_savings(runs: list[Run]) -> pd.DataFrame:
    """One row per run that is not NonShared, where a NonShared run of its workload is given (same
    model and trajectories: Run.mismatch); empty otherwise. Repeats: the first run of each."""
    baselines: dict[str, Run] = {}
    fullshared: dict[str, Run] = {}
    for run in runs:
        if run.is_floor or run.is_quality_baseline:
            continue
        if run.method == "nonshared":
            baselines.setdefault(run.workload, run)
        elif run.method == "fullshared" and run.name == "fullshared":
            fullshared.setdefault(run.workload, run)
    rows = []
    for run in runs:
        base = baselines.get(run.workload)
        if run.method == "nonshared" or run.is_floor or base is None or run.mismatch(base) is not None:
            continue
        reuse, first = _turns(run, True), _turns(run, False)
        naive = fullshared.get(run.workload)
        rows.append({
            "run": run.cell, "reuse_turns": int(reuse["success"].sum()), "p50_reuse_ttft_ms": _p50(reuse),
            "reuse_vs_nonshared": _ratio(reuse, _turns(base, True)),
            "reuse_vs_fullshared": (_ratio(reuse, _turns(naive, True)) if naive is not None and naive is not run
                                    and run.mismatch(naive) is None else ""),
            "p50_first_ttft_ms": _p50(first),
            "first_vs_nonshared": _ratio(first, _turns(base, False)),
        })
    return pd.DataFrame(rows, columns=COLUMNS)
