"""Over-saturation: a loaded run whose work arrives faster than the server finishes it.

Past its capacity a server's queue grows for as long as the run lasts, and so does every
request's time to first token: the run's figures then measure how long it ran, not the server
(guidellm stops such benchmarks for the same reason). The replayer feeds the detector, at every
finished request, the time, that request's TTFT and the backlog (workflows that have arrived and
not finished); the detector fits both against time by least squares. The run is over-saturated
when both slopes are positive beyond their 95% interval (lower bound > 0) and the fitted TTFT
grew at least `min_ttft_growth` times over the span observed, once at least `min_duration_s`
and `min_requests` have been seen. A steady run's backlog and TTFT fluctuate around a level:
their slopes stay within noise of zero.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

Z_95 = 1.96


@dataclass(frozen=True)
class SaturationRule:
    min_duration_s: float = 20.0  # no verdict before this much of the run
    min_requests: int = 16  # nor before this many finished requests
    min_ttft_growth: float = 2.0  # the fitted TTFT at the last request over the one at the first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SaturationVerdict:
    at_s: float  # when it was reached (seconds since the run's start)
    requests: int  # finished requests it was fitted on
    ttft_slope_ms_per_s: float
    ttft_slope_low: float  # the slope's 95% lower bound
    backlog_slope_per_s: float
    backlog_slope_low: float
    ttft_growth: float  # fitted TTFT at the last request over the fitted one at the first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"over-saturated at {self.at_s:.1f} s: TTFT grows {self.ttft_slope_ms_per_s:.0f} ms/s "
                f"({self.ttft_growth:.1f}x over the run) and the backlog {self.backlog_slope_per_s:.2f} "
                f"workflows/s, both beyond noise ({self.requests} requests)")


class _Fit:
    """Running sums of an ordinary least-squares line y = a + b x."""

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y
        self.syy += y * y

    def line(self) -> tuple[float, float, float] | None:
        """(intercept, slope, the slope's standard error); None when x does not vary."""
        n = self.n
        sxx = self.sxx - self.sx * self.sx / n
        if n < 3 or sxx <= 0:
            return None
        sxy = self.sxy - self.sx * self.sy / n
        syy = self.syy - self.sy * self.sy / n
        slope = sxy / sxx
        residual = max(0.0, syy - slope * sxy)  # the squared residuals' sum
        error = math.sqrt(residual / (n - 2) / sxx)
        return (self.sy - slope * self.sx) / n, slope, error


class SaturationDetector:
    def __init__(self, rule: SaturationRule | None = None) -> None:
        self.rule = rule or SaturationRule()
        self._ttft, self._backlog = _Fit(), _Fit()
        self._first_s: float | None = None
        self.verdict: SaturationVerdict | None = None

    def observe(self, t_s: float, ttft_ms: float, backlog: int) -> SaturationVerdict | None:
        """A request finished at `t_s` (since the run's start) with `ttft_ms`, `backlog` workflows
        arrived and unfinished; the verdict once the run is over-saturated (then kept)."""
        if self.verdict is not None:
            return self.verdict
        if not (math.isfinite(t_s) and math.isfinite(ttft_ms)):
            return None
        if self._first_s is None:
            self._first_s = t_s
        self._ttft.add(t_s, ttft_ms)
        self._backlog.add(t_s, float(backlog))
        rule = self.rule
        if t_s < rule.min_duration_s or self._ttft.n < rule.min_requests:
            return None
        ttft, queue = self._ttft.line(), self._backlog.line()
        if ttft is None or queue is None:
            return None
        (a, b, se_b), (_, q, se_q) = ttft, queue
        start, end = a + b * self._first_s, a + b * t_s
        growth = end / start if start > 0 else math.inf
        if b - Z_95 * se_b > 0 and q - Z_95 * se_q > 0 and growth >= rule.min_ttft_growth:
            self.verdict = SaturationVerdict(t_s, self._ttft.n, b, b - Z_95 * se_b, q, q - Z_95 * se_q, growth)
        return self.verdict


class SaturationWatch:
    """A replay's view of its own load for the detector: workflows started and ended (the backlog
    is their difference) and each finished request. No detector: the run is never stopped."""

    def __init__(self, rule: SaturationRule | None) -> None:
        self.detector = SaturationDetector(rule) if rule is not None else None
        self.started = self.ended = 0

    @property
    def verdict(self) -> SaturationVerdict | None:
        return self.detector.verdict if self.detector is not None else None

    def finished(self, end_s: float, ttft_ms: float | None) -> SaturationVerdict | None:
        """A request answered at `end_s` with `ttft_ms`: the verdict when this one reaches it."""
        if self.detector is None or ttft_ms is None or self.detector.verdict is not None:
            return None
        return self.detector.observe(end_s, ttft_ms, self.started - self.ended)
