"""Bootstrap intervals of p50 TTFT ratios between two runs (no engine)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvbench.analysis.intervals import RatioInterval, p50_ratio_interval, ttft_by_trajectory
from kvbench.analysis.metrics import summarize


def _run(scale: float, trajectories: int = 12, agents: int = 4, seed: int = 0) -> pd.DataFrame:
    """A run's requests: each trajectory has its own queueing delay shared by its turns."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(trajectories):
        queue = rng.exponential(50.0)
        for agent in range(agents):
            rows.append({"trajectory_id": f"t{t}", "agent_index": agent, "success": True,
                         "ttft_ms": scale * (100.0 + queue + rng.normal(0, 5)), "tpot_ms": 1.0, "e2el_ms": 1.0,
                         "itl_ms": [1.0], "scheduled_ns": 0, "end_ns": 10**9, "prompt_tokens": 10,
                         "output_tokens": 2, "shared_tokens": 0, "reusable_tokens": 0, "cached_tokens": None})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("per,key", [("request", "p50_ttft_ms"), ("trajectory", "p50_trajectory_ttft_ms")])
def test_the_point_estimate_is_the_ratio_of_the_summaries_p50(per: str, key: str) -> None:
    slow, fast = _run(3.0, seed=1), _run(1.0, seed=2)
    slow.loc[3, "success"] = False  # a failed turn: out of the request p50, and its trajectory out of the other
    interval = p50_ratio_interval(slow, fast, per=per)  # type: ignore[arg-type]
    expected = summarize(slow, 1.0, [50])[key] / summarize(fast, 1.0, [50])[key]
    assert interval.ratio == pytest.approx(expected, rel=1e-12)
    assert interval.low <= interval.ratio <= interval.high


def test_a_clear_gap_is_met_and_identical_runs_are_within_noise() -> None:
    slow, fast = _run(3.0, seed=1), _run(1.0, seed=2)
    gap = p50_ratio_interval(slow, fast)
    assert 2.0 < gap.low < 3.0 < gap.high < 4.5
    assert gap.verdict(at_least=2.0) == "met"
    assert gap.verdict(at_most=1.3) == "not met"
    same = p50_ratio_interval(_run(1.0, seed=3), _run(1.0, seed=4))
    assert same.low < 1.0 < same.high
    assert same.verdict(at_least=1.0) == "within noise"
    # same data, same seed: the same interval
    assert p50_ratio_interval(slow, fast) == gap


def test_resampling_whole_trajectories_widens_the_interval_of_correlated_turns() -> None:
    """Turns of a trajectory share its queueing: 12 independent trajectories carry less
    information than 48 independent requests, and the interval says so."""
    correlated = _run(1.0, trajectories=12, seed=5)
    independent = correlated.assign(trajectory_id=[f"r{i}" for i in range(len(correlated))])
    reference = _run(1.0, trajectories=48, agents=1, seed=6)
    wide = p50_ratio_interval(correlated, reference)
    narrow = p50_ratio_interval(independent, reference)
    assert wide.ratio == narrow.ratio
    assert wide.high - wide.low > narrow.high - narrow.low


def test_runs_of_the_same_trajectories_are_resampled_in_pairs() -> None:
    """A run and its 1.5x copy: paired resamples pick the same trajectories on both sides, so
    every resample's ratio is 1.5; unpaired (other ids), it spreads."""
    base = _run(1.0, seed=7)
    slower = base.assign(ttft_ms=base["ttft_ms"] * 1.5)
    paired = p50_ratio_interval(slower, base)
    assert paired.low == pytest.approx(1.5) and paired.high == pytest.approx(1.5)
    renamed = slower.assign(trajectory_id="other-" + slower["trajectory_id"])
    unpaired = p50_ratio_interval(renamed, base)
    assert unpaired.ratio == pytest.approx(1.5) and unpaired.low < 1.4 and unpaired.high > 1.6


def test_verdicts_and_bad_input() -> None:
    assert RatioInterval(1.2, 1.1, 1.25, 0.95).verdict(at_most=1.3) == "met"
    assert RatioInterval(1.2, 1.1, 1.4, 0.95).verdict(at_most=1.3) == "within noise"
    assert RatioInterval(1.5, 1.35, 1.6, 0.95).verdict(at_most=1.3) == "not met"
    assert RatioInterval(2.5, 2.1, 2.9, 0.95).verdict(at_least=2.0) == "met"
    assert RatioInterval(1.5, 1.2, 1.9, 0.95).verdict(at_least=2.0) == "not met"
    with pytest.raises(ValueError, match="exactly one"):
        RatioInterval(1.0, 0.9, 1.1, 0.95).verdict()
    one = _run(1.0, trajectories=1)
    with pytest.raises(ValueError, match="at least two"):
        p50_ratio_interval(one, _run(1.0))
    with pytest.raises(ValueError, match="per must be"):
        ttft_by_trajectory(one, "turn")  # type: ignore[arg-type]
