"""`kvbench compare`: two sets of runs side by side, with regression gates for CI."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pandas as pd

from kvbench.analysis.intervals import RatioInterval, p50_ratio_interval
from kvbench.analysis.runs import Run

# Metrics where larger is better; every other gated metric is a cost (latency, bytes, failures).
HIGHER_IS_BETTER = re.compile(r"throughput|completed|realized_rho|eligible_rho|goodput")
# Metrics whose candidate/baseline ratio gets a bootstrap interval (over which TTFTs it is a p50).
INTERVAL_METRICS = {"p50_ttft_ms": "request", "p50_trajectory_ttft_ms": "trajectory"}


@dataclass(frozen=True)
class Gate:
    """`metric=+10%`: the candidate may be at most 10% worse than the baseline.
    `metric:num/den=-10%`: the ratio of two methods' values within each side may fall at most 10%
    (ratios measured inside one run are robust to a slower or busier machine)."""

    metric: str
    tolerance: float  # fraction, >= 0
    ratio: tuple[str, str] | None = None

    @classmethod
    def parse(cls, text: str) -> Gate:
        match = re.fullmatch(r"([A-Za-z0-9_.]+)(?::([\w.-]+)/([\w.-]+))?=([+-]?)(\d+(?:\.\d+)?)%", text.strip())
        if not match:
            raise ValueError(f"bad gate {text!r}; expected METRIC=+10% or METRIC:METHOD_A/METHOD_B=-10%")
        metric, num, den, _, amount = match.groups()
        return cls(metric, float(amount) / 100, (num, den) if num else None)

    @property
    def label(self) -> str:
        subject = f"{self.metric}[{self.ratio[0]}/{self.ratio[1]}]" if self.ratio else self.metric
        return f"{subject} within {self.tolerance:.0%}"


def _value(runs: list[Run], metric: str, method: str | None = None) -> float:
    values = [run.summary.get(metric) for run in runs if method is None or run.method == method]
    values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not values:
        return math.nan
    return sum(values) / len(values)


def ratio_interval(baseline: list[Run], candidate: list[Run], metric: str, method: str) -> RatioInterval | None:
    """The 95% bootstrap interval of candidate/baseline for a p50 TTFT metric, where each side
    holds one run of the method with at least two trajectories (None otherwise: repeats are
    averaged, and their interval is the repeats' own spread)."""
    per = INTERVAL_METRICS.get(metric)
    base = [run for run in baseline if run.method == method]
    cand = [run for run in candidate if run.method == method]
    if per is None or len(base) != 1 or len(cand) != 1:
        return None
    try:
        return p50_ratio_interval(cand[0].requests, base[0].requests, per=per)  # type: ignore[arg-type]
    except ValueError:  # fewer than two trajectories on a side
        return None


def compare_table(baseline: list[Run], candidate: list[Run], metrics: list[str]) -> pd.DataFrame:
    """Per method: baseline, candidate and candidate/baseline for each metric; for p50 TTFT, the
    ratio's 95% bootstrap interval over trajectories (ratio_low, ratio_high): a change whose
    interval holds 1 is within the runs' noise."""
    rows = []
    methods = sorted({r.method for r in baseline} | {r.method for r in candidate})
    for method in methods:
        for metric in metrics:
            base, cand = _value(baseline, metric, method), _value(candidate, metric, method)
            interval = ratio_interval(baseline, candidate, metric, method)
            rows.append({"method": method, "metric": metric, "baseline": base, "candidate": cand,
                         "ratio": cand / base if base and not math.isnan(base) else math.nan,
                         "ratio_low": interval.low if interval else math.nan,
                         "ratio_high": interval.high if interval else math.nan})
    return pd.DataFrame(rows)


def evaluate_gates(baseline: list[Run], candidate: list[Run], gates: list[Gate]) -> pd.DataFrame:
    rows = []
    for gate in gates:
        if gate.ratio:
            num, den = gate.ratio
            base = _value(baseline, gate.metric, num) / _value(baseline, gate.metric, den)
            cand = _value(candidate, gate.metric, num) / _value(candidate, gate.metric, den)
            # A method ratio (e.g. nonshared/fullshared TTFT = speed-up) regresses when it falls.
            higher_better = True
        else:
            base, cand = _value(baseline, gate.metric), _value(candidate, gate.metric)
            higher_better = bool(HIGHER_IS_BETTER.search(gate.metric))
        if math.isnan(base) or math.isnan(cand):
            passed, change = False, math.nan  # a gated metric that is missing fails loudly
        else:
            # from a zero baseline, any change is unbounded; none is none (e.g. 0 failures both times)
            change = (cand - base) / abs(base) if base else (0.0 if cand == base else math.copysign(math.inf, cand))
            passed = change >= -gate.tolerance if higher_better else change <= gate.tolerance
        rows.append({"gate": gate.label, "baseline": base, "candidate": cand, "change": change,
                     "direction": "higher is better" if higher_better else "lower is better",
                     "status": "pass" if passed else "FAIL"})
    return pd.DataFrame(rows)


def markdown_report(table: pd.DataFrame, gates: pd.DataFrame) -> str:
    lines = ["# kvbench compare", "", table.to_markdown(index=False, floatfmt=".3f"), ""]
    if len(gates):
        failed = int((gates["status"] == "FAIL").sum())
        lines += ["## Gates", "", gates.to_markdown(index=False, floatfmt=".3f"), "",
                  f"**{'REGRESSION: ' + str(failed) + ' gate(s) failed' if failed else 'all gates passed'}**", ""]
    return "\n".join(lines)
