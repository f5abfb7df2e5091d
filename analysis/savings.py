"""What reuse saves, turn by turn: each method's reuse turns (turns some earlier cache could serve)
and first turns (turns that reuse nothing) against NonShared's same turns of the same workload,
as p50 TTFT ratios with a 95% bootstrap interval over trajectories, beside the noise floor (the
A/A arm's same ratio: NonShared against itself in the same comparison). A ratio whose interval
holds 1, or meets the noise floor's, is no finding. Runs are paired only within one comparison."""

from __future__ import annotations

import math

import pandas as pd

from kvbench.analysis.intervals import RatioInterval, p50_ratio_interval
from kvbench.analysis.runs import Run

COLUMNS = ["run", "reuse_turns", "p50_reuse_ttft_ms", "reuse_vs_nonshared", "reuse_noise_floor", "reuse_finding",
           "reuse_repeats", "reuse_vs_fullshared", "p50_first_ttft_ms", "first_vs_nonshared", "first_noise_floor",
           "first_finding"]


def _turns(run: Run, reuse: bool) -> pd.DataFrame:
    requests = run.requests
    reusable = requests["reusable_tokens"].fillna(0) > 0
    return requests[reusable if reuse else ~reusable]


def _interval(numerator: pd.DataFrame, denominator: pd.DataFrame) -> RatioInterval | str:
    """The p50 ratio with its interval, or the reason there is none."""
    try:
        interval = p50_ratio_interval(numerator, denominator)
    except ValueError:  # fewer than two trajectories on a side
        return "n/a (fewer than 2 trajectories)"
    return "n/a" if math.isnan(interval.ratio) else interval


def _text(interval: RatioInterval | str | None) -> str:
    if interval is None:
        return ""
    if isinstance(interval, str):
        return interval
    return f"{interval.ratio:.2f} [{interval.low:.2f}, {interval.high:.2f}]"


def finding(interval: RatioInterval | str, floor: RatioInterval | str | None) -> str:
    """What a ratio to NonShared says: `faster` or `slower` where its interval excludes 1 and
    does not overlap the A/A arm's (the noise floor: NonShared against itself, in the same
    comparison); `within noise` otherwise. Without an A/A arm, the interval against 1 only."""
    if isinstance(interval, str):
        return ""
    overlaps = (isinstance(floor, RatioInterval) and interval.low <= floor.high and floor.low <= interval.high)
    if interval.low <= 1 <= interval.high or overlaps:
        return "within noise"
    return ("faster" if interval.high < 1 else "slower") + ("" if isinstance(floor, RatioInterval) else
                                                            " (no A/A arm: noise floor unknown)")


def _p50(turns: pd.DataFrame) -> float:
    ttft = turns.loc[turns["success"], "ttft_ms"].dropna()
    return float(ttft.median()) if len(ttft) else math.nan


def comparison_key(run: Run) -> tuple[str, str | None]:
    """Runs are compared within one workload and one comparison (never across invocations)."""
    return run.workload, run.comparison


def baseline_runs(runs: list[Run]) -> tuple[dict[tuple[str, str | None], Run], dict[tuple[str, str | None], Run]]:
    """By comparison key: the NonShared run each method is read against, and the A/A arm (the
    first of each; PGR's floor and a sweep's quality baselines are neither)."""
    baselines: dict[tuple[str, str | None], Run] = {}
    floors: dict[tuple[str, str | None], Run] = {}
    for run in runs:
        if run.is_floor or run.is_quality_baseline or run.method != "nonshared":
            continue
        (floors if run.is_noise_floor else baselines).setdefault(comparison_key(run), run)
    return baselines, floors


def reuse_turn_savings(runs: list[Run]) -> pd.DataFrame:
    """One row per run that is not the NonShared baseline, where a NonShared run of its workload and
    comparison is given (same model and trajectories: Run.mismatch); empty otherwise. The A/A arm
    (NonShared again) has its row, and its ratios are every row's noise floor. Repeats: each against
    its own comparison's NonShared run where they are comparisons (an interleaved sweep), with the
    spread of the reuse ratio between them (`reuse_repeats`); otherwise the first run of each."""
    baselines, floors = baseline_runs(runs)
    fullshared: dict[tuple[str, str | None], Run] = {}
    for run in runs:
        if run.method == "fullshared" and run.name == "fullshared" and not run.is_quality_baseline:
            fullshared.setdefault(comparison_key(run), run)
    noise: dict[tuple[str, str | None], tuple[RatioInterval | str, RatioInterval | str]] = {}
    for key, aa in floors.items():
        base = baselines.get(key)
        if base is not None and aa.mismatch(base) is None:
            noise[key] = (_interval(_turns(aa, True), _turns(base, True)),
                          _interval(_turns(aa, False), _turns(base, False)))
    rows = []
    repeats: dict[tuple[str, str], list[float]] = {}  # a method's reuse ratio in each repeat's own comparison
    for run in runs:
        base = baselines.get(comparison_key(run))
        if run is base or run.is_floor or base is None or run.mismatch(base) is not None:
            continue
        if run.method == "nonshared" and not run.is_noise_floor:
            continue  # another NonShared run of the workload: a repeat of the baseline
        reuse, first = _turns(run, True), _turns(run, False)
        naive = fullshared.get(comparison_key(run))
        floor_reuse, floor_first = noise.get(comparison_key(run), (None, None))
        if run.is_noise_floor and floor_reuse is not None and floor_first is not None:
            reuse_ratio, first_ratio = floor_reuse, floor_first  # its own ratios, taken above
        else:
            reuse_ratio, first_ratio = _interval(reuse, _turns(base, True)), _interval(first, _turns(base, False))
        if isinstance(reuse_ratio, RatioInterval):
            repeats.setdefault((run.name, run.workload), []).append(reuse_ratio.ratio)
        rows.append({
            "key": (run.name, run.workload), "run": run.cell, "reuse_turns": int(reuse["success"].sum()),
            "p50_reuse_ttft_ms": _p50(reuse),
            "reuse_vs_nonshared": _text(reuse_ratio), "reuse_noise_floor": _text(floor_reuse),
            "reuse_finding": "noise floor" if run.is_noise_floor else finding(reuse_ratio, floor_reuse),
            "reuse_vs_fullshared": (_text(_interval(reuse, _turns(naive, True))) if naive is not None
                                    and naive is not run and run.mismatch(naive) is None else ""),
            "p50_first_ttft_ms": _p50(first),
            "first_vs_nonshared": _text(first_ratio), "first_noise_floor": _text(floor_first),
            "first_finding": "noise floor" if run.is_noise_floor else finding(first_ratio, floor_first),
        })
    for row in rows:  # the spread between repeats, beside each one's interval within its run
        ratios = repeats.get(row.pop("key"), [])
        row["reuse_repeats"] = f"{min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)}" if len(ratios) > 1 else ""
    return pd.DataFrame(rows, columns=COLUMNS)
