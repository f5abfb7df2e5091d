"""`kvbench compare`: two sets of runs side by side, with regression gates for CI."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import pandas as pd

from kvbench.analysis import metric_catalog
from kvbench.analysis.intervals import RatioInterval, p50_ratio_interval, ratio_change_interval
from kvbench.analysis.runs import Run, mean_summary

# Metrics whose candidate/baseline ratio gets a bootstrap interval (over which TTFTs it is a p50).
INTERVAL_METRICS = {"p50_ttft_ms": "request", "p50_trajectory_ttft_ms": "trajectory"}
NoisePolicy = Literal["fail", "pass"]


@dataclass(frozen=True)
class Gate:
    """`metric=+10%`: the candidate may be at most 10% worse than the baseline. `metric=-0.05`
    (no %): at most 0.05 worse, in the metric's own units (for shares such as pgr or
    exact_match_rate). `metric:num/den=-10%`: the ratio of two methods' values within each side may
    fall at most 10% (ratios measured inside one run are robust to a slower or busier machine)."""

    metric: str
    tolerance: float  # >= 0: a fraction of the baseline, or an amount when absolute
    ratio: tuple[str, str] | None = None
    absolute: bool = False

    @classmethod
    def parse(cls, text: str) -> Gate:
        match = re.fullmatch(r"([A-Za-z0-9_.]+)(?::([\w.-]+)/([\w.-]+))?=([+-]?)(\d+(?:\.\d+)?)(%?)", text.strip())
        if not match:
            raise ValueError(f"bad gate {text!r}; expected METRIC=+10%, METRIC=-0.05 or METRIC:METHOD_A/METHOD_B=-10%")
        metric, num, den, _, amount, percent = match.groups()
        if percent:
            return cls(metric, float(amount) / 100, (num, den) if num else None)
        if num:
            raise ValueError(f"bad gate {text!r}: a ratio of two methods takes a % tolerance")
        return cls(metric, float(amount), None, absolute=True)

    def __post_init__(self) -> None:
        if self.ratio is None:  # which way is worse comes from the catalog (a ratio of two methods: falling)
            try:
                better = metric_catalog.lookup(self.metric).better
            except metric_catalog.UnknownMetric as exc:
                raise ValueError(f"bad gate: {exc}") from None
            if better is None:
                raise ValueError(f"bad gate: {self.metric} is neither better higher nor lower (the metric catalog)")

    @property
    def higher_better(self) -> bool:
        # A method ratio (e.g. nonshared/fullshared TTFT = speed-up) regresses when it falls.
        return self.ratio is not None or metric_catalog.lookup(self.metric).better == "higher"

    @property
    def label(self) -> str:
        subject = f"{self.metric}[{self.ratio[0]}/{self.ratio[1]}]" if self.ratio else self.metric
        return f"{subject} within {self.tolerance:g}" if self.absolute else f"{subject} within {self.tolerance:.0%}"


def _value(runs: list[Run], metric: str, method: str | None = None) -> float:
    return mean_summary([run for run in runs if method is None or run.method == method], metric)


def cells(runs: list[Run], rename: dict[str, str] | None = None) -> dict[str, list[Run]]:
    """Runs by grid cell (method configuration and workload); `rename` maps a run's name (label,
    else method) to the name it is paired under."""
    grouped: dict[str, list[Run]] = {}
    for run in runs:
        key = run.cell
        if rename and run.name in rename:
            key = f"{rename[run.name]} {run.workload}".strip()
        grouped.setdefault(key, []).append(run)
    return grouped


def ratio_interval(baseline: list[Run], candidate: list[Run], metric: str) -> RatioInterval | None:
    """The 95% bootstrap interval of candidate/baseline for a p50 TTFT metric, where each side
    holds one run with at least two trajectories (None otherwise: repeats are averaged, and their
    interval is the repeats' own spread)."""
    per = INTERVAL_METRICS.get(metric)
    if per is None or len(baseline) != 1 or len(candidate) != 1 or not len(baseline[0].requests) \
            or not len(candidate[0].requests):
        return None
    try:
        return p50_ratio_interval(candidate[0].requests, baseline[0].requests, per=per)  # type: ignore[arg-type]
    except ValueError:  # fewer than two trajectories on a side
        return None


def mismatches(baseline: list[Run], candidate: list[Run], pairs: dict[str, str] | None = None) -> list[str]:
    """Warnings: paired cells whose runs replayed other traces or models, and cells with no
    counterpart on the other side."""
    base, cand = cells(baseline), cells(candidate, pairs)
    warnings = []
    for key in sorted(set(base) & set(cand)):
        reason = base[key][0].mismatch(cand[key][0])
        if reason:
            warnings.append(f"{key}: {reason}; its comparison may not mean what it says")
    alone = sorted(set(base) ^ set(cand))
    if alone:
        warnings.append("cells on one side only (no comparison; pair different methods with --pair BASE=CAND): "
                        + "; ".join(alone))
    return warnings


def comparable_runs(baseline: list[Run], candidate: list[Run], pairs: dict[str, str] | None = None
                    ) -> tuple[list[Run], list[Run], str | None]:
    """The runs of the cells on both sides that replayed the same trajectories with the same
    model: what gates are evaluated on. With none, ([], [], why): a gate then compares nothing."""
    base, cand = cells(baseline), cells(candidate, pairs)
    shared = sorted(set(base) & set(cand))
    if not shared:
        return [], [], (f"no cell is on both sides (baseline: {'; '.join(sorted(base)) or 'none'}; candidate: "
                        f"{'; '.join(sorted(cand)) or 'none'}); pair different methods with --pair BASE=CAND")
    same = [key for key in shared if base[key][0].mismatch(cand[key][0]) is None]
    if not same:
        reasons = sorted({str(base[key][0].mismatch(cand[key][0])) for key in shared})
        return [], [], "every cell on both sides replayed something else: " + "; ".join(reasons)
    return [r for key in same for r in base[key]], [r for key in same for r in cand[key]], None


def unknown_gate_metrics(runs: list[Run], gates: list[Gate]) -> list[str]:
    """Gates on a key no run's summary holds (a typo would otherwise fail as NaN), each with the
    nearest keys."""
    import difflib

    known = set().union(*(run.summary for run in runs)) if runs else set()
    problems = []
    for gate in gates:
        if gate.metric not in known:
            close = difflib.get_close_matches(gate.metric, sorted(known), n=3)
            problems.append(f"{gate.metric!r} is no summary.json key of these runs"
                            + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return problems


def compare_table(baseline: list[Run], candidate: list[Run], metrics: list[str],
                  pairs: dict[str, str] | None = None) -> pd.DataFrame:
    """Per grid cell present on both sides: baseline, candidate and candidate/baseline for each
    metric; for p50 TTFT, the ratio's 95% bootstrap interval over trajectories (ratio_low,
    ratio_high): a change whose interval holds 1 is within the runs' noise."""
    base, cand = cells(baseline), cells(candidate, pairs)
    rows = []
    for key in sorted(set(base) & set(cand)):
        for metric in metrics:
            b, c = _value(base[key], metric), _value(cand[key], metric)  # the mean over a cell's repeats
            interval = ratio_interval(base[key], cand[key], metric)
            known = metric_catalog.find(metric)
            rows.append({"cell": key, "method": base[key][0].method, "metric": metric,
                         "better": (known.better if known else None) or "-",
                         "baseline": b, "candidate": c,
                         "ratio": c / b if b and not math.isnan(b) else math.nan,
                         "ratio_low": interval.low if interval else math.nan,
                         "ratio_high": interval.high if interval else math.nan})
    return pd.DataFrame(rows, columns=["cell", "method", "metric", "better", "baseline", "candidate", "ratio", "ratio_low",
                                       "ratio_high"])


def _noise_interval(baseline: list[Run], candidate: list[Run], gate: Gate) -> RatioInterval | None:
    """For a gate on a p50 TTFT of one run per side: the candidate/baseline ratio's bootstrap
    interval; for a gate on a ratio of two methods' p50 TTFT (a speed-up) with one run of each per
    side: the interval of how that ratio moved. None where it cannot be computed."""
    if gate.metric not in INTERVAL_METRICS:
        return None
    if not gate.ratio:
        return ratio_interval(baseline, candidate, gate.metric)
    runs = {}
    for side, side_runs in (("base", baseline), ("cand", candidate)):
        for role, method in zip(("num", "den"), gate.ratio):
            matching = [r for r in side_runs if r.method == method]
            if len(matching) != 1 or not len(matching[0].requests):
                return None
            runs[side + role] = matching[0].requests
    try:
        return ratio_change_interval(runs["basenum"], runs["baseden"], runs["candnum"], runs["candden"],
                                     per=INTERVAL_METRICS[gate.metric])  # type: ignore[arg-type]
    except ValueError:
        return None


def evaluate_gates(baseline: list[Run], candidate: list[Run], gates: list[Gate],
                   noise: NoisePolicy = "fail") -> pd.DataFrame:
    """One row per gate. A failure whose ratio interval holds 1 (the change is within the runs'
    noise) is reported as such, and fails or passes by `noise`."""
    rows = []
    for gate in gates:
        if gate.ratio:
            num, den = gate.ratio
            base = _value(baseline, gate.metric, num) / _value(baseline, gate.metric, den)
            cand = _value(candidate, gate.metric, num) / _value(candidate, gate.metric, den)
        else:
            base, cand = _value(baseline, gate.metric), _value(candidate, gate.metric)
        higher_better = gate.higher_better
        within_noise = False
        if math.isnan(base) or math.isnan(cand):
            passed, change = False, math.nan  # a gated metric that is missing fails loudly
        elif gate.absolute:
            change = cand - base
            passed = change >= -gate.tolerance if higher_better else change <= gate.tolerance
        else:
            # from a zero baseline, any change is unbounded; none is none (e.g. 0 failures both times)
            change = (cand - base) / abs(base) if base else (0.0 if cand == base else math.copysign(math.inf, cand))
            passed = change >= -gate.tolerance if higher_better else change <= gate.tolerance
        if not passed and not math.isnan(change):
            interval = _noise_interval(baseline, candidate, gate)
            within_noise = interval is not None and interval.low <= 1.0 <= interval.high
        if passed:
            status = "pass"
        elif within_noise:
            status = "FAIL (within noise)" if noise == "fail" else "pass (within noise)"
        else:
            status = "FAIL"
        rows.append({"gate": gate.label, "baseline": base, "candidate": cand, "change": change,
                     "direction": "higher is better" if higher_better else "lower is better", "status": status})
    return pd.DataFrame(rows)


def saturation_gate(baseline: list[Run], candidate: list[Run], pairs: dict[str, str] | None = None) -> dict | None:
    """A gate row failing on cells the candidate ran over-saturated where the baseline did not (its
    figures then describe a growing queue: no gate on them means anything); None where neither
    side saturated."""
    base, cand = cells(baseline), cells(candidate, pairs)
    if not any(r.saturated for rs in (*base.values(), *cand.values()) for r in rs):
        return None
    newly = sorted(key for key in set(base) & set(cand)
                   if any(r.saturated for r in cand[key]) and not any(r.saturated for r in base[key]))
    return {"gate": "no cell newly saturated", "baseline": math.nan, "candidate": float(len(newly)),
            "change": float(len(newly)), "direction": "lower is better",
            "status": f"FAIL ({', '.join(newly)})" if newly else "pass"}


def timing_gates(gates: list[Gate]) -> list[Gate]:
    """Gates a loaded machine invalidates: on timings and rates (not failures, quality, reuse or memory)."""
    return [gate for gate in gates if metric_catalog.lookup(gate.metric).speed_dependent]


def loaded_runs(runs: list[Run]) -> list[str]:
    """The runs whose machine other processes loaded while they ran (summary `machine_loaded`),
    each with the share of the cores those used: their timings measured the neighbours too."""
    return [f"{run.cell} ({run.path}): other processes used {run.others_cpu_share or 0:.0%} of the cores"
            for run in runs if run.machine_loaded]


def failed(gates: pd.DataFrame) -> int:
    return int(gates["status"].str.startswith("FAIL").sum()) if len(gates) else 0


def markdown_report(table: pd.DataFrame, gates: pd.DataFrame, warnings: list[str] | None = None) -> str:
    lines = ["# kvbench compare", ""]
    if warnings:
        lines += ["## Warnings", "", *[f"- {w}" for w in warnings], ""]
    lines += [table.to_markdown(index=False, floatfmt=".3f") if len(table) else "(no cell on both sides)", ""]
    if len(gates):
        count = failed(gates)
        lines += ["## Gates", "", gates.to_markdown(index=False, floatfmt=".3f"), "",
                  f"**{'REGRESSION: ' + str(count) + ' gate(s) failed' if count else 'all gates passed'}**", ""]
    return "\n".join(lines)
