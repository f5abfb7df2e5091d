"""Benchmark: every method at a comparable reuse ratio (issue 37 item 4). Each method's defaults
put it at its own rho (CacheBlend 0.85, RelayCaching 0.3-0.6, the delta methods 0.5-0.8), so a
default-parameter table compares operating points as much as methods. Here each method's budget
is first calibrated to one target rho on a calibration trace of its own (another seed), as
`kvbench calibrate` does (DroidSpeak: its layer group profiled), then the method runs on the
measurement trace at that setting, beside NonShared and FullShared: task accuracy on reuse turns
with its 95% interval and exact McNemar p-value against FullShared, realized rho, recompute share,
p50 TTFT.

    .venv/bin/python benchmarks/bench_comparable_rho.py --result-dir DIR [--model kvbench:roles-transferable] \\
        [--target-rho 0.8] [--context 2048] [--trajectories 24] [--calibration-trajectories 8] [--warmups 3]

DIR/calibration.json keeps each method's calibrated setting (rerun the same command to resume: it
and finished cells are kept); DIR/sweep/ holds the runs; DIR/matrix.{md,csv,json,png} the table.
A method whose rho does not reach the target within --tolerance is run at its closest setting and
the table says so: that is a finding, not a failure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvbench.analysis.deviation import write_matrix
from kvbench.analysis.runs import find_runs
from kvbench.experiment.calibrate import best_step, calibrate_threshold, profile_layers, what_limits, within
from kvbench.experiment.sweep import MethodConfig, SweepPoint, SweepSpec
from kvbench.experiment.sweep_runner import run_sweep
from kvbench.methods.registry import method_spec, resolve_method
from kvbench.model.resolve import resolve_model
from kvbench.server.config import method_server_config
from kvbench.server.lifecycle import VLLMServer
from kvbench.tracegen.generate import TraceSpec, generate_trace, task_roles
from kvbench.tracegen.schema import Trace
from kvbench.tracegen.tasks.recall import recall_output_len
from kvbench.tracegen.tokenizer import load_tokenizer

CALIBRATED = ("kvcmas", "kvcmas-nonchained", "kvcomm", "kvcomm-ref", "graphflow", "cacheblend", "relaycaching",
              "droidspeak")
REFERENCES = ("nonshared", "fullshared")


def calibrate_method(method: str, model: str, trace: Trace, tokenizer: Any, target: float, warmups: int,
                     tolerance: float, log_dir: Path) -> dict[str, Any]:
    """The method's setting for the target rho on the calibration trace, with what it realized."""
    cls = method_spec(method)
    config = method_server_config(resolve_method(method, {}), resolve_model(model), log_path=log_dir / f"{method}.log")
    with VLLMServer(config) as server:
        if cls.layer_profiled:
            profile = profile_layers(trace, tokenizer, resolve_method(method), server.base_url, resolve_model(model), target)
            return {"params": {"layers": list(profile.layers)}, "profiled_turns": profile.turns,
                    "layer_deviation": [round(d, 6) for d in profile.deviation]}
        assert cls.threshold_name is not None, f"{method} has nothing to calibrate"
        steps = calibrate_threshold(trace, tokenizer, resolve_method(method), server.base_url, target, cls.threshold_name,
                                    num_warmups=warmups, tolerance=tolerance, threshold_range=cls.threshold_range,
                                    rho_rises=cls.rho_rises_with_threshold)
    best = best_step(steps, target)
    result: dict[str, Any] = {"params": {cls.threshold_name: best.threshold},
                              "calibration_rho": best.realized_rho, "reached": within(best.realized_rho, target, tolerance),
                              "steps": [[s.threshold, s.realized_rho] for s in steps]}
    if not result["reached"]:
        result["what_limits"] = what_limits(steps)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result-dir", type=Path, required=True)
    parser.add_argument("--model", default="kvbench:roles-transferable")
    parser.add_argument("--methods", default=",".join(CALIBRATED))
    parser.add_argument("--target-rho", type=float, default=0.8)
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--trajectories", type=int, default=24)
    parser.add_argument("--calibration-trajectories", type=int, default=8)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args()
    methods = args.methods.split(",")
    if unknown := sorted(set(methods) - set(CALIBRATED)):
        parser.error(f"nothing to calibrate for {unknown}; choose from {', '.join(CALIBRATED)}")
    tokenizer = load_tokenizer(args.model)
    output_len = recall_output_len(tokenizer.encode)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    store = args.result_dir / "calibration.json"
    calibration: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    setting = {"model": args.model, "target_rho": args.target_rho, "context": args.context, "seed": args.seed,
               "calibration_trajectories": args.calibration_trajectories, "warmups": args.warmups}
    if calibration.get("setting", setting) != setting:
        parser.error(f"{store} was calibrated for {calibration['setting']}: use another --result-dir")
    calibration["setting"] = setting
    spec = TraceSpec(num_agents=4, shared_tokens=args.context, task="role-recall", roles=task_roles("role-recall"),
                     output_len=output_len, num_trajectories=args.calibration_trajectories + args.warmups,
                     seed=args.seed + 1000)  # other contents than the measured trajectories
    header, trajectories = generate_trace(spec, tokenizer)
    trace = Trace(header=header, trajectories=trajectories)
    for method in methods:
        if method in calibration.get("methods", {}):
            continue
        started = time.monotonic()
        result = calibrate_method(method, args.model, trace, tokenizer, args.target_rho, args.warmups,
                                  args.tolerance, args.result_dir / "calibration-logs")
        calibration.setdefault("methods", {})[method] = result
        store.write_text(json.dumps(calibration, indent=2) + "\n")
        print(f"[{time.strftime('%H:%M:%S')}] {method}: {result['params']} "
              f"({(time.monotonic() - started) / 60:.1f} min)", flush=True)
    configs = [MethodConfig(m) for m in REFERENCES] + [
        MethodConfig(m, calibration["methods"][m]["params"], label=m) for m in methods]
    sweep = SweepSpec(methods=configs, points=[SweepPoint(args.context, 0.0)], task="role-recall",
                      output_len=output_len, num_trajectories=args.trajectories, num_warmups=args.warmups,
                      prime_method_state=True, seed=args.seed, model=args.model)
    run_sweep(sweep, args.result_dir / "sweep",
              on_cell=lambda name: print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True))
    paths = write_matrix(find_runs([args.result_dir / "sweep"]), args.result_dir)
    print(paths["markdown"].read_text())
    for method in methods:
        entry = calibration["methods"][method]
        note = "" if entry.get("reached", True) else f"  (target not reached: {entry.get('what_limits', '')})"
        print(f"{method}: {entry['params']}{note}")


if __name__ == "__main__":
    main()
