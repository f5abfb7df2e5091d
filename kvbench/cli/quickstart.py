"""`kvbench quickstart`: the main job on the embedded default, end to end."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("quickstart")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("results/quickstart"),
              show_default=True, help="Directory for the trace, the runs and the report.")
@click.option("--qps", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Trajectory arrivals per second.")
@click.option("--num-trajectories", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--shared-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.pass_context
def quickstart_command(ctx: click.Context, out: Path, qps: float, num_trajectories: int, shared_tokens: int) -> None:
    """Build the embedded model if needed, generate a four-agent trace, replay it with NonShared and
    FullShared inside vLLM, and report the two side by side."""
    from datetime import datetime

    from kvbench.cli.analysis import report_command
    from kvbench.cli.replay import replay_command
    from kvbench.cli.trace import gen_trace_command
    from kvbench.model.store import resolve_model

    click.echo("[1/4] embedded model (shipped with kvbench)", err=True)
    click.echo(f"      {resolve_model(None)}", err=True)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    click.echo("[2/4] trace", err=True)
    ctx.invoke(gen_trace_command, output=trace, num_trajectories=num_trajectories + 1, shared_tokens=shared_tokens,
               qps=qps)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    runs = []
    for step, method in (("3/4", "nonshared"), ("3/4", "fullshared")):
        click.echo(f"[{step}] replay ({method})", err=True)
        runs.append(out / f"{method}-{stamp}")
        ctx.invoke(replay_command, trace_path=trace, method=method, qps=qps, num_warmups=1, result_dir=runs[-1],
                   label=method)
    click.echo("[4/4] report", err=True)
    ctx.invoke(report_command, result_dirs=tuple(runs), out=out / f"report-{stamp}",
               title="kvbench quickstart: NonShared vs FullShared")
