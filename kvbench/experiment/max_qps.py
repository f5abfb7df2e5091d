"""`kvbench sweep --find-max-qps`: per method configuration and workload, the highest arrival rate
whose goodput share (the workflows, or requests, meeting every `--goodput` bound) stays at or
above a target, as vLLM's `serve_sla` and guidellm's sweep search for a rate.

Each probe is an ordinary sweep cell at that QPS (same folder layout, so `report` and `compare`
read it, and a rerun resumes from the probes already done), on one server per method
configuration. The search doubles the rate from a start while probes pass and halves it while
they fail, within a range, then bisects geometrically between the last passing and the first
failing rate. The answer is that bracket, beside each probe's share and its 95% (Wilson)
interval over the trajectories or requests it counted: a probe passing by a margin its interval
does not clear is a pass the next run may not repeat.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kvbench import run_files
from kvbench.experiment.sweep import SweepCell, SweepSpec, cell_dir, cell_done, prepare_sweep
from kvbench.experiment.sweep_calibration import calibrated_params
from kvbench.experiment.sweep_runner import replay_cell, sweep_servers

MAX_QPS_FILE = "max_qps.json"
# The rates a search may probe: below a workflow every 1,000 s nothing loads a server, above 10,000
# a second no replayer here keeps its schedule.
QPS_LIMITS = (1e-3, 1e4)
CONFIDENCE_Z = 1.96
GoodputMetric = Literal["workflow", "request"]


@dataclass(frozen=True)
class Probe:
    qps: float
    share: float  # the goodput share at this rate (NaN: the replay failed)
    good: int
    counted: int
    low: float  # its 95% Wilson interval
    high: float
    passed: bool
    run: str  # the cell's folder, relative to the sweep


def wilson_interval(good: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (sound at 0 and 1 and for few trials)."""
    if total <= 0:
        return math.nan, math.nan
    p = good / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def least_counted(target_share: float) -> int:
    """The fewest workflows (or requests) a probe must count for an all-good probe's 95% interval
    to reach `target_share`: with fewer, no probe can show it meets the share."""
    n = 1
    while wilson_interval(n, n, CONFIDENCE_Z)[0] < target_share:
        n += 1
        if n > 100_000:
            raise ValueError(f"a goodput share of {target_share:g} cannot be shown with 95% confidence")
    return n


def check_range(qps_range: tuple[float, float]) -> None:
    """Refuse a range outside QPS_LIMITS (before any work)."""
    low, high = qps_range
    if not (QPS_LIMITS[0] <= low < high <= QPS_LIMITS[1]):
        raise ValueError(f"--qps-range {low:g},{high:g}: a search probes rates from {QPS_LIMITS[0]:g} to "
                         f"{QPS_LIMITS[1]:g} QPS, LOW below HIGH")


def check_search(target_share: float, qps_range: tuple[float, float], counted_per_probe: int, unit: str) -> str | None:
    """Refuse a range outside QPS_LIMITS; warn (the returned text) where probes are too small to
    show the target share with confidence: one workflow 'passing' a 0.9 share proves nothing, and
    its pass is the point estimate's, which the next run may not repeat."""
    check_range(qps_range)
    needed = least_counted(target_share)
    if counted_per_probe < needed:
        return (f"each probe counts {counted_per_probe} {unit}: even all meeting the bounds, its 95% interval cannot "
                f"reach a share of {target_share:g} (that needs {needed}); a pass is the point estimate's, not shown "
                "with confidence (add --num-trajectories)")
    return None


def search_rates(probe: Callable[[float], Probe], start: float, low: float, high: float, steps: int) -> list[Probe]:
    """Probes in the order the search ran them: doubling from `start` while they pass (up to
    `high`), halving while they fail (down to `low`), then `steps` geometric bisections of the
    bracket between the last passing and the first failing rate."""
    probes = [probe(start)]
    while probes[-1].passed and probes[-1].qps < high:
        probes.append(probe(min(high, probes[-1].qps * 2)))
    while not any(p.passed for p in probes) and probes[-1].qps > low:  # (after a pass: the bracket is known)
        probes.append(probe(max(low, probes[-1].qps / 2)))
    for _ in range(steps):
        passing, failing = bracket(probes)
        if passing is None or failing is None or failing / passing < 1.05:
            break
        probes.append(probe(_rounded(math.sqrt(passing * failing))))
    return probes


def bracket(probes: list[Probe]) -> tuple[float | None, float | None]:
    """(highest passing rate below the lowest failing one, that failing rate): the answer."""
    failing = min((p.qps for p in probes if not p.passed), default=None)
    passing = max((p.qps for p in probes if p.passed and (failing is None or p.qps < failing)), default=None)
    return passing, failing


def _rounded(qps: float) -> float:
    """Three significant digits: folder names stay readable and a rerun probes the same rates."""
    return float(f"{qps:.3g}")


def find_max_qps(spec: SweepSpec, root: Path, target_share: float = 0.9, metric: GoodputMetric = "workflow",
                 qps_range: tuple[float, float] = (0.125, 16.0), steps: int = 3,
                 on_probe: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Search every method configuration on every workload of `spec` (its goodput bounds, its
    first --qps as the start); writes and returns max_qps.json."""
    from kvbench.replay.result_lock import result_dir_lock
    from kvbench.server.lifecycle import VLLMServer

    if not spec.goodput:
        raise ValueError("--find-max-qps needs the bounds of goodput: --goodput ttft:MS (and/or tpot, e2el, workflow)")
    if not 0 < target_share <= 1:
        raise ValueError(f"--goodput-share must be in (0, 1], got {target_share}")
    low, high = qps_range
    start = min(max(spec.qps[0] if spec.qps and spec.qps[0] > 0 else 1.0, low), high)
    check_range(qps_range)
    workloads = {point.shared_tokens: point.num_trajectories or spec.num_trajectories for point in spec.grid_points()}
    results = []
    with result_dir_lock(root):
        inputs = prepare_sweep(spec, root)
        # what one probe counts: its trajectories, or (a request metric) every turn of them
        counted = min(workloads.get(int(trace.header.generator.get("shared_tokens") or 0), spec.num_trajectories)
                      * (1 if metric == "workflow" else len(trace.trajectories[0].turns))
                      for trace in inputs.traces.values())
        warning = check_search(target_share, qps_range, counted, "workflows" if metric == "workflow" else "requests")
        if warning and on_probe:
            on_probe(f"warning: {warning}")
        for method in spec.methods:
            config = inputs.server_config(spec, root, method)
            with VLLMServer(config) if spec.instances == 1 else sweep_servers(spec, config) as server:
                for trace_id, trace in inputs.traces.items():
                    context = int(trace.header.generator.get("shared_tokens") or 0)
                    trajectories = workloads.get(context, spec.num_trajectories)
                    params = calibrated_params(spec, root, inputs, method, trace_id, server)  # --target-rho

                    def probe(qps: float, method: Any = method, trace_id: str = trace_id, context: int = context,
                              trajectories: int = trajectories, params: dict[str, Any] = params) -> Probe:
                        cell = SweepCell(method, trace_id, context, qps, trajectories, 0,
                                         cell_dir(root, method, trace_id, qps, 0))
                        summary = (json.loads((cell.path / run_files.SUMMARY).read_text()) if cell_done(cell.path)
                                   else replay_cell(spec, cell, server, inputs, None, params))
                        found = probe_of(cell, root, summary, metric, target_share)
                        if on_probe:
                            on_probe(f"{method.name} {trace_id} QPS {qps:g}: {metric} goodput {found.share:.1%} "
                                     f"[{found.low:.1%}, {found.high:.1%}] {'pass' if found.passed else 'fail'}")
                        return found

                    probes = search_rates(probe, start, low, high, steps)
                    passing, failing = bracket(probes)
                    results.append({"method": method.name, "trace": trace_id, **answer(passing, failing, high),
                                    "probes": [asdict(p) for p in probes]})
    report = {"target_share": target_share, "metric": metric, "goodput_slo": spec.goodput,
              "qps_range": list(qps_range), "warning": warning, "results": results}
    run_files.write_text_atomic(root / MAX_QPS_FILE, json.dumps(report, indent=2) + "\n")
    return report


def answer(passing: float | None, failing: float | None, high: float) -> dict[str, Any]:
    """max_qps with what it means: a bracket, or why there is none (no probe failed: the server was
    never loaded to its limit, and the highest rate probed is no maximum)."""
    if failing is None:
        return {"max_qps": None, "first_failing_qps": None, "passed_up_to": passing,
                "reason": f"no probe failed up to {high:g} QPS, the range's top: the server was never loaded to its "
                          "limit here (raise --qps-range's top, or give the probes more trajectories)"}
    if passing is None:
        return {"max_qps": None, "first_failing_qps": failing, "passed_up_to": None,
                "reason": "every probe failed, down to the range's bottom"}
    return {"max_qps": passing, "first_failing_qps": failing, "passed_up_to": passing, "reason": None}


def probe_of(cell: SweepCell, root: Path, summary: dict[str, Any] | None, metric: GoodputMetric,
             target_share: float) -> Probe:
    """A replayed cell as a probe: its goodput share and the counts behind it."""
    run = str(cell.path.relative_to(root))
    if summary is None:
        return Probe(cell.qps, math.nan, 0, 0, math.nan, math.nan, False, run)
    share = summary.get(f"{metric}_goodput_share")
    counted = (int(summary.get("completed_trajectories", 0)) + int(summary.get("failed_trajectories", 0))
               if metric == "workflow" else int(summary.get("completed", 0)) + int(summary.get("failed", 0)))
    if share is None or not counted:
        return Probe(cell.qps, math.nan, 0, counted, math.nan, math.nan, False, run)
    good = round(share * counted)
    low, high = wilson_interval(good, counted)
    return Probe(cell.qps, float(share), good, counted, low, high, share >= target_share, run)
