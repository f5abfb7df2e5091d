"""`kvbench replay --method a,b,c`: several methods compared on one trace at QPS 0, each on a server
of its own, interleaved (kvbench.experiment.interleaved) or one after another, each run in a folder
of its own under the comparison's; then a table of each run's figures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvbench.experiment.interleaved import AA_ARM
from kvbench.methods.api.spec import ChosenMethod


def compare_methods(methods: list[ChosenMethod], root: Path, aa: bool, interleave: bool,
                    make_config: Callable[[ChosenMethod, str, Path], Any],
                    server_config: Callable[[ChosenMethod, Path], Any],
                    cpu_kv_cache_gib: float, model: str) -> None:
    """Replay `methods` (and the NonShared A/A arm when `aa`) under `root`; print their figures."""
    from kvbench.experiment.interleaved import (
        Arm,
        comparison_arms,
        replay_interleaved,
        side_by_side_shortfall,
        weights_bytes,
    )
    from kvbench.experiment.replay import ReplayInputError, run_replay_experiment
    from kvbench.methods.registry import resolve_method
    from kvbench.replay.interrupts import Interrupted
    from kvbench.replay.result_lock import ResultDirError
    from kvbench.replay.run_config import ReplayError
    from kvbench.server.errors import ServerError

    method_of = {m.name: m for m in methods} | ({AA_ARM: resolve_method("nonshared")} if aa else {})
    names = list(method_of)
    try:
        arms = [Arm(make_config(method_of[name], name, root / name),
                    lambda log, m=method_of[name]: server_config(m, log)) for name in names]
    except ReplayInputError as exc:
        raise click.UsageError(str(exc)) from None
    if interleave and (shortfall := side_by_side_shortfall(len(arms), cpu_kv_cache_gib, weights_bytes(model))):
        click.echo(f"warning: {shortfall}: the methods run one after another, one server at a time. Each method's "
                   "trajectories then run minutes apart from the others', so a drift on the machine between them reads "
                   "as a difference between methods (the A/A arm shows how much); a smaller --cpu-kv-cache-gib or "
                   "fewer methods keep them interleaved", err=True)
        interleave = False

    def announce(config: Any) -> None:
        click.echo(f"starting a vLLM server for {config.log_path.parent.name} ({model}) ... log: {config.log_path}",
                   err=True)

    summaries: dict[str, dict[str, Any]] = {}
    try:
        if interleave:
            click.echo(f"{len(arms)} runs take turns a trajectory at a time: {', '.join(names)}", err=True)
            summaries = replay_interleaved(arms, announce=announce,
                                           on_note=lambda note: click.echo(f"note: {note}", err=True))
        else:
            for arm in comparison_arms(arms, interleaved=False):
                summaries[arm.name] = run_replay_experiment(arm.config, arm.server, announce=announce)
    except (ServerError, ReplayError, ResultDirError) as exc:
        raise click.ClickException(f"{exc} (the runs' folders are under {root})") from None
    except Interrupted:
        click.echo(f"stopped: what each run recorded is kept under {root}; finish with --resume --result-dir {root}",
                   err=True)
        raise
    print_comparison(summaries, interleave)
    click.echo(f"results: {root} (kvbench report {root})")


def print_comparison(summaries: dict[str, dict[str, Any]], interleaved: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvbench replay: " + ("interleaved" if interleaved else "one after another") + " at QPS 0")
    for column in ("run", "completed / failed", "p50 TTFT ms", "p90 TTFT ms", "reuse share", "task accuracy",
                   "others' CPU"):
        table.add_column(column)
    for name, summary in summaries.items():
        reuse, accuracy, others = (summary.get(k) for k in ("reuse_share", "task_accuracy", "others_cpu_share"))
        table.add_row(name, f"{summary['completed']} / {summary['failed']}", f"{summary['p50_ttft_ms']:.1f}",
                      f"{summary['p90_ttft_ms']:.1f}", "-" if reuse is None else f"{reuse:.1%}",
                      "-" if accuracy is None else f"{accuracy:.1%}", "-" if others is None else f"{others:.0%}")
    Console().print(table)
    from kvbench.cli.run_notes import load_warning

    for name, summary in summaries.items():
        if (warning := load_warning(summary)) is not None:
            Console(stderr=True).print(f"[yellow]loaded machine ({name}):[/] {warning}")
