"""Confidence intervals: ratios of p50 TTFT between two runs, and means of per-turn scores.

A median over a few dozen requests under Poisson arrivals moves by more than many targets'
margins between identical runs, so a ratio of two runs' medians is reported with a bootstrap
interval. Turns of one trajectory share its arrival and its queueing, so the bootstrap resamples
whole trajectories (a cluster bootstrap). Two runs of the same trace (the same trajectory ids)
are resampled in pairs, the same trajectories on both sides: how hard a trajectory's content is
then cancels out of the ratio. Otherwise each run is resampled on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
from scipy import stats

from kvbench.analysis.metrics import trajectory_table

Per = Literal["request", "trajectory"]


@dataclass(frozen=True)
class RatioInterval:
    """numerator p50 / denominator p50, with its bootstrap interval at `confidence`."""

    ratio: float
    low: float
    high: float
    confidence: float

    def verdict(self, at_most: float | None = None, at_least: float | None = None) -> str:
        """'met' when the whole interval meets the bound, 'not met' when none of it does, else
        'within noise'."""
        if (at_most is None) == (at_least is None):
            raise ValueError("give exactly one of at_most, at_least")
        if at_most is not None:
            met, missed = self.high <= at_most, self.low > at_most
        else:
            met, missed = self.low >= at_least, self.high < at_least  # type: ignore[operator]
        return "met" if met else "not met" if missed else "within noise"


def ttft_by_trajectory(requests: pd.DataFrame, per: Per) -> dict[str, np.ndarray]:
    """A run's TTFTs (ms) by trajectory id: every successful request's (per='request'), or each
    completed trajectory's mean (per='trajectory', the paper's definition), as the run's summary
    counts them."""
    if per == "trajectory":
        table = trajectory_table(requests)
        return {str(t): np.array([m]) for t, m in zip(table["trajectory_id"], table["mean_ttft_ms"])}
    if per != "request":
        raise ValueError(f"per must be 'request' or 'trajectory', got {per!r}")
    ok = requests[requests["success"] & requests["ttft_ms"].notna()]
    return {str(t): group.to_numpy(dtype=float) for t, group in ok.groupby("trajectory_id")["ttft_ms"]}


def p50_ttft_ms(requests: pd.DataFrame, per: Per = "request") -> float:
    """A run's p50 TTFT over its requests or over its trajectories' means, as the ratios count it."""
    return float(np.median(np.concatenate(list(ttft_by_trajectory(requests, per).values()))))


def p50_ratio_interval(numerator: pd.DataFrame, denominator: pd.DataFrame, per: Per = "request",
                       confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> RatioInterval:
    """p50 TTFT of `numerator`'s requests over `denominator`'s (two runs' requests tables), with a
    percentile-bootstrap interval from resampling trajectories (in pairs where both runs hold the
    same ones)."""
    by_id = (ttft_by_trajectory(numerator, per), ttft_by_trajectory(denominator, per))
    for name, run in zip(("numerator", "denominator"), by_id):
        if len(run) < 2:
            raise ValueError(f"{name}: a bootstrap over trajectories needs at least two, got {len(run)}")
    paired = by_id[0].keys() == by_id[1].keys()
    groups = tuple([run[t] for t in sorted(run)] for run in by_id)  # paired: index i is one trajectory on both

    def p50(run: list[np.ndarray], picks: np.ndarray) -> float:
        return float(np.median(np.concatenate([run[int(i)] for i in picks])))

    def ratio(picks_num: np.ndarray, picks_den: np.ndarray) -> float:
        return p50(groups[0], picks_num) / p50(groups[1], picks_den)

    indices = tuple(np.arange(len(run), dtype=float) for run in groups)
    result = stats.bootstrap(indices, ratio, n_resamples=resamples, confidence_level=confidence,
                             method="percentile", vectorized=False, paired=paired,
                             rng=np.random.default_rng(seed))
    point = ratio(*indices)
    return RatioInterval(point, float(result.confidence_interval.low), float(result.confidence_interval.high),
                         confidence)


def ratio_change_interval(base_num: pd.DataFrame, base_den: pd.DataFrame, cand_num: pd.DataFrame,
                          cand_den: pd.DataFrame, per: Per = "request", confidence: float = 0.95,
                          resamples: int = 2000, seed: int = 0) -> RatioInterval:
    """How a ratio of two methods' p50 TTFT (e.g. NonShared / KVCMAS: a speed-up) moved from a
    baseline to a candidate: (cand_num / cand_den) / (base_num / base_den), with a percentile
    bootstrap interval. Each side's two runs replayed one trace: they are resampled together,
    trajectory by trajectory; the two sides independently (what a CI job compares: two machines'
    runs of the same trace)."""
    sides = []
    for num, den in ((base_num, base_den), (cand_num, cand_den)):
        a, b = ttft_by_trajectory(num, per), ttft_by_trajectory(den, per)
        common = sorted(set(a) & set(b))
        if len(common) < 2:
            raise ValueError(f"a bootstrap over trajectories needs two both runs hold, got {len(common)}")
        sides.append(([a[t] for t in common], [b[t] for t in common]))
    rng = np.random.default_rng(seed)

    def side_ratio(side: tuple[list[np.ndarray], list[np.ndarray]], picks: np.ndarray) -> float:
        num, den = side
        return float(np.median(np.concatenate([num[i] for i in picks])) /
                     np.median(np.concatenate([den[i] for i in picks])))

    everyone = [np.arange(len(side[0])) for side in sides]
    point = side_ratio(sides[1], everyone[1]) / side_ratio(sides[0], everyone[0])
    draws = [side_ratio(sides[1], rng.integers(0, len(sides[1][0]), len(sides[1][0])))
             / side_ratio(sides[0], rng.integers(0, len(sides[0][0]), len(sides[0][0]))) for _ in range(resamples)]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return RatioInterval(point, float(low), float(high), confidence)


def cluster_mean_interval(values: pd.Series, trajectories: pd.Series, confidence: float = 0.95,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of per-turn `values` (NaN left out), resampling
    whole trajectories (`trajectories`: each turn's id), as the TTFT ratios do: turns of one
    trajectory share its content. (NaN, NaN) without values."""
    frame = pd.DataFrame({"value": pd.to_numeric(values, errors="coerce").to_numpy(dtype=float),
                          "trajectory": trajectories.to_numpy()}).dropna()
    by_trajectory = frame.groupby("trajectory")["value"].agg(["sum", "count"])
    if not len(by_trajectory):
        return float("nan"), float("nan")
    totals, counts = by_trajectory["sum"].to_numpy(float), by_trajectory["count"].to_numpy(float)
    draws = np.random.default_rng(seed).integers(0, len(totals), size=(resamples, len(totals)))
    means = totals[draws].sum(axis=1) / counts[draws].sum(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)
