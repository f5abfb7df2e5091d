"""`kvbench calibrate`: a method's threshold for a target reuse ratio, or DroidSpeak's layer group."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from kvbench.cli.inputs import check_method, load_trace
from kvbench.cli.param_types import FiniteFloatRange, allow_code_execution_option
from kvbench.cli.server_options import ServerOptions, server_options
from kvbench.cli.workload_options import WorkloadOptions, workload_options
from kvbench.methods.api.spec import ChosenMethod


@click.command("calibrate")
@click.option("--method", required=True,
              help="A gated delta-correction method (kvcmas, kvcmas-nonchained, kvcomm): bisects its threshold; "
                   "graphflow: its reuse budget rho; droidspeak: profiles layer-wise deviation and picks its layer "
                   "group.")
@click.option("--target-rho", type=FiniteFloatRange(0, 1), required=True,
              help="Reuse ratio to reach: shared tokens served by accepted corrections / eligible shared tokens.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Calibration trace [default: a four-agent trace generated in memory]. A benchmark workload "
                   "(gen-trace --task mmlu|gsm8k|humaneval) calibrates the threshold for that task, as the paper "
                   "picked tau per task.")
@click.option("--iterations", type=click.IntRange(1, 12), default=6, show_default=True, help="Bisection steps.")
@click.option("--tolerance", type=FiniteFloatRange(min=0), default=0.05, show_default=True,
              help="Exit 1 when no step came within this of the target rho.")
@click.option("--base-url", default=None, help="A running server with the method [default: start one].")
@workload_options({"num_trajectories": 8, "num_warmups": 2, "seed": 1, "shared_tokens": 2048, "output_len": 32},
                  helps={"num_warmups": "Trajectories run before each measured replay to fill the method's state "
                                         "(anchor pools), as a measured run with --prime-method-state does: the "
                                         "threshold is found for the steady state."})
@allow_code_execution_option
@server_options
def calibrate_command(method: str, target_rho: float, trace_path: Path | None, iterations: int, tolerance: float,
                      base_url: str | None, workload: WorkloadOptions, server: ServerOptions) -> None:
    """Find the gate threshold (tau; gamma for kvcomm; GraphFlow's budget rho; CacheBlend's
    recompute_ratio; RelayCaching's tau_dev) that reaches a target reuse ratio, or DroidSpeak's
    recomputed layer group (offline layer-wise deviation profiling)."""
    from kvbench.experiment.calibrate import calibrate_threshold, flat_rho, summary_dict, what_limits, within
    from kvbench.experiment.servers import server_url
    from kvbench.server.errors import ServerError

    chosen = check_method(method, server.method_params)
    cls = chosen.spec
    if cls.layer_profiled:
        trace, tokenizer, served = load_trace(trace_path, server.model, replace(workload, num_warmups=0))
        _profile_layers_command(chosen, trace, tokenizer, served, target_rho, base_url, server)
        return
    if cls.threshold_name is None:
        raise click.BadParameter(f"{method!r} has no reliability gate, reuse budget or layer group to calibrate",
                                 param_hint="--method")
    trace, tokenizer, served = load_trace(trace_path, server.model, workload)

    ranges = {"threshold_range": cls.threshold_range, "rho_rises": cls.rho_rises_with_threshold}

    def show(step) -> None:
        click.echo(f"  {cls.threshold_name}={step.threshold:.4f} -> realized rho {step.realized_rho:.3f}", err=True)

    try:
        with server_url(base_url, lambda: server.server_config(chosen, served)) as url:
            steps = calibrate_threshold(trace, tokenizer, chosen, url, target_rho, cls.threshold_name,
                                        iterations, show, workload.num_warmups, tolerance, **ranges)
    except ServerError as exc:
        raise click.ClickException(str(exc)) from None
    report = summary_dict(steps, target_rho, cls.threshold_name)
    task = next((t.task.name for t in trace.trajectories if t.task is not None), None)
    if task is not None:  # a benchmark workload (gen-trace --task mmlu ...): the threshold is per task
        report["task"] = task
    click.echo(json.dumps(report, indent=2))
    if not within(report["realized_rho"], target_rho, tolerance) and flat_rho(steps):
        tried = ", ".join(f"{s.threshold:.4f}" for s in steps)
        raise click.ClickException(
            f"target rho {target_rho:g} is out of reach: rho is {steps[-1].realized_rho:.3f} at every "
            f"{cls.threshold_name} tried ({tried}), so the threshold is not what limits it: {what_limits(steps)}")
    if not within(report["realized_rho"], target_rho, tolerance):
        raise click.ClickException(
            f"target rho {target_rho:g} is out of reach on this trace: the closest step realized "
            f"{report['realized_rho']:.3f} ({cls.threshold_name}={report[cls.threshold_name]:.4f}); more --iterations, "
            "another --trace or a larger --tolerance")


def _profile_layers_command(method: ChosenMethod, trace: Any, tokenizer: Any, served: str,
                            target_rho: float, base_url: str | None, server: ServerOptions) -> None:
    """DroidSpeak's profiling: the layer group to recompute for a target reuse ratio."""
    from kvbench.experiment.calibrate import profile_layers
    from kvbench.experiment.servers import server_url
    from kvbench.server.errors import ServerError

    try:
        with server_url(base_url, lambda: server.server_config(method, served)) as url:
            profile = profile_layers(trace, tokenizer, method, url, served, target_rho)
    except (ServerError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps({"target_rho": target_rho, "layers": list(profile.layers),
                           "layer_deviation": [round(d, 6) for d in profile.deviation],
                           "profiled_turns": profile.turns}, indent=2))
