"""What several commands read from their flags alike: method parameters checked against the
method's spec, and the trace (read or generated in memory) with its errors as CLI errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kvbench.cli.param_types import require_code_execution_here
from kvbench.cli.workload_options import WorkloadOptions
from kvbench.methods.api.spec import ChosenMethod


def key_values(items: tuple[str, ...], option: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        pairs[key] = value
    return pairs


def parse_method_params(items: tuple[str, ...]) -> dict[str, Any]:
    """--method-param values are JSON where they parse (numbers, booleans), else strings."""
    params: dict[str, Any] = {}
    for key, raw in key_values(items, "--method-param").items():
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def check_method(method: str, method_params: tuple[str, ...]) -> ChosenMethod:
    """The command's one lookup of its method: the name and its --method-param checked, then
    passed down resolved."""
    from kvbench.methods.registry import resolve_method

    try:
        return resolve_method(method, parse_method_params(method_params))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--method/--method-param") from None


def load_trace(trace_path: Path | None, model: str | None, workload: WorkloadOptions) -> tuple[Any, Any, str]:
    """kvbench.experiment.replay.load_trace, its errors as CLI errors; a trace whose scoring runs
    model-written code (HumanEval) is refused here without consent, before a server starts."""
    from kvbench.experiment.replay import load_trace as load
    from kvbench.tracegen.schema import TraceError

    try:
        trace, tokenizer, served = load(trace_path, model, workload.num_trajectories, workload.num_warmups,
                                        workload.shared_tokens, workload.output_len, workload.seed)
    except (TraceError, ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    from kvbench.tracegen.tasks.registry import runs_model_code

    if runs_model_code({t.task.name for t in trace.trajectories if t.task is not None}):
        require_code_execution_here()  # scoring it runs model-written code: refused before a server starts
    return trace, tokenizer, served
