"""`sweep --target-rho`: each configuration of a gated method is first set to a target reuse ratio
on its own server (kvbench.experiment.calibrate's bisection over its threshold), on a calibration
trace of the same shape as the cells' and other trajectories (another seed: the threshold is not
fitted to the measured items), replayed as a cell is: as many trajectories and warm-ups, and the
method state primed by them only under --prime-method-state (a delta method's anchor pool starts
cold in a cell and sends its first segments dense; a calibration on a warm pool would not see it).
The threshold found is recorded once per (configuration, trace) in `calibration/` and reused when
the sweep resumes; every cell records its target and threshold."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvbench import run_files
from kvbench.experiment.sweep import MethodConfig, SweepInputs, SweepSpec

CALIBRATION_SEED_OFFSET = 1000  # the calibration trace's seed: the sweep's + this
CALIBRATION_TOLERANCE = 0.05


def calibration_path(root: Path, method: MethodConfig, trace_id: str) -> Path:
    return root / "calibration" / f"{method.name}-{trace_id}.json"


def calibrated_params(spec: SweepSpec, root: Path, inputs: SweepInputs, method: MethodConfig, trace_id: str,
                      server: Any) -> dict[str, Any]:
    """The configuration's parameters with its threshold set for `method.target_rho` on trace
    `trace_id` (found now on `server`, or read from an earlier run of the sweep), and set on
    every one of the server's instances; its parameters unchanged without a target."""
    from kvbench.experiment.calibrate import calibrate_threshold, summary_dict, what_limits, within
    from kvbench.server.worker_rpc import WorkerClient

    if method.target_rho is None:
        return dict(method.params)
    gate = method.chosen.spec
    assert gate.threshold_name is not None  # sweep gives targets to methods with a threshold only
    path = calibration_path(root, method, trace_id)
    if path.exists():
        report = json.loads(path.read_text())
    else:
        trace = _calibration_trace(spec, inputs, trace_id)
        for url in server.base_urls:  # the configuration's own parameters, then the threshold's probes
            WorkerClient(url).set_params(dict(method.params))
        steps = calibrate_threshold(trace, inputs.tokenizer, method.chosen, server.base_urls[0], method.target_rho,
                                    gate.threshold_name, num_warmups=spec.num_warmups,
                                    prime_method_state=spec.prime_method_state,
                                    tolerance=CALIBRATION_TOLERANCE, threshold_range=gate.threshold_range,
                                    rho_rises=gate.rho_rises_with_threshold)
        report = {**summary_dict(steps, method.target_rho, gate.threshold_name), "trace": trace_id,
                  "seed": trace.header.generator.get("seed"),  # the one its trace was drawn with
                  "trajectories": len(trace.trajectories),
                  "num_warmups": spec.num_warmups, "prime_method_state": spec.prime_method_state}
        if not within(report["realized_rho"], method.target_rho, CALIBRATION_TOLERANCE):
            report["what_limits"] = what_limits(steps)  # why the target was not reached
        path.parent.mkdir(parents=True, exist_ok=True)
        run_files.write_text_atomic(path, json.dumps(report, indent=2) + "\n")
    params = {**method.params, gate.threshold_name: report[gate.threshold_name]}
    for url in server.base_urls:
        WorkerClient(url).set_params(params)
    return params


def _calibration_trace(spec: SweepSpec, inputs: SweepInputs, trace_id: str) -> Any:
    """The cells' trace with other trajectories (another seed), warm-ups first."""
    from kvbench.tracegen.generate import generate_trace
    from kvbench.tracegen.schema import Trace

    trace_spec = dataclasses.replace(spec.trace_specs()[trace_id], seed=spec.seed + CALIBRATION_SEED_OFFSET)
    header, trajectories = generate_trace(trace_spec, inputs.tokenizer)  # as many trajectories as the longest cell
    return Trace(header=header, trajectories=trajectories)
