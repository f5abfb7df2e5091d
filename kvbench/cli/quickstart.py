"""`kvbench quickstart`: the main job on the embedded default, end to end."""

from __future__ import annotations

from pathlib import Path

import click

from kvbench.cli.param_types import FiniteFloatRange
from kvbench.tracegen.generate import task_model
from kvbench.tracegen.schema import MAX_SEGMENT_TOKENS
from kvbench.tracegen.tasks.registry import task_names


@click.command("quickstart")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("results/quickstart"),
              show_default=True, help="Directory for the trace, the runs and the report.")
@click.option("--qps", type=FiniteFloatRange(min=0), default=0.0, show_default=True,
              help="Trajectory arrivals per second (0: one trajectory after another, so every turn's TTFT is its "
                   "method's own, without queueing).")
@click.option("--num-trajectories", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--shared-tokens", type=click.IntRange(min=1, max=MAX_SEGMENT_TOKENS), default=8192, show_default=True,
              help="The shared context's length. 8K: on the embedded models (8 layers, hidden size 256) a 2K "
                   "prefill costs about as much as a reuse method's fixed costs per turn, so reuse saves little "
                   "there; at 8K the prefill a method avoids dominates, as on the paper's models at any context.")
@click.option("--model", default=None,
              help="The model [default: with role-recall, kvbench:roles-transferable, a constructed test model on "
                   "which an agent reading another agent's cache answers the other agent's question and delta "
                   "correction can recover it (docs/models.md); with --task none, the shipped kvbench:recall-v1].")
@click.option("--task", type=click.Choice(task_names()), default="role-recall", show_default=True,
              help="The trace's task (gen-trace --task): role-recall scores every answer on reuse turns.")
@click.option("--num-warmups", type=click.IntRange(min=0), default=3, show_default=True,
              help="Trajectories each replay runs first (and leaves out); KVCMAS keeps what it learned from them.")
@click.option("--enforce-eager/--no-enforce-eager", default=True, show_default=True,
              help="Run vLLM eager (its --enforce-eager): no torch.compile warm-up, so each of the five servers "
                   "starts in about a quarter of the time, and decoding is slower. Every method runs alike, so the "
                   "comparison holds; for absolute figures use `kvbench replay`/`sweep`, compiled by default.")
@click.pass_context
def quickstart_command(ctx: click.Context, out: Path, qps: float, num_trajectories: int, shared_tokens: int,
                       model: str | None, task: str, num_warmups: int, enforce_eager: bool) -> None:
    """Generate a four-agent trace, replay it inside vLLM with NonShared, FullShared and KVCMAS,
    compare their outputs with NonShared's (exact match, token F1, first-token KL, PGR against a
    run without the shared context) and, on a task trace, score their answers, and report both
    axes: what each saves (reuse turns' TTFT against NonShared's, with intervals) and what it
    costs."""
    from datetime import datetime

    from kvbench.cli.analysis import quality_command, report_command
    from kvbench.cli.replay import replay_command
    from kvbench.cli.trace import gen_trace_command
    from kvbench.model.resolve import resolve_model
    from kvbench.model.store import is_constructed
    from kvbench.run_files import AA_LABEL, FLOOR_LABEL

    model = model or task_model(task) or "kvbench:recall-v1"
    constructed = " (a constructed test model, built on first use)" if is_constructed(model) else ""
    click.echo(f"[1/5] model {model}{constructed}", err=True)
    click.echo(f"      {resolve_model(model)}", err=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(f"cannot write to the result folder {out}: {exc.strerror or exc}") from None
    trace = out / "trace.jsonl"
    click.echo("[2/5] trace", err=True)
    ctx.invoke(gen_trace_command, output=trace, num_trajectories=num_trajectories + num_warmups,
               shared_tokens=shared_tokens, qps=qps, task=task, model=model)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    vllm_args = ("--enforce-eager",) if enforce_eager else ()  # recorded in each run's server_command
    root = out / f"compare-{stamp}"  # one comparison: its runs are paired with each other only
    runs = {name: root / name for name in ("nonshared", "fullshared", "kvcmas", AA_LABEL, FLOOR_LABEL)}
    # NonShared is the reference (its outputs: what the others are compared with; its logprobs: the
    # first-token KL); NonShared again is the noise floor; the no-context run is PGR's floor.
    if qps == 0:
        click.echo("[3/5] replay: NonShared, FullShared, KVCMAS and NonShared again (the noise floor), each on its own "
                   "server, taking turns a trajectory at a time", err=True)
        ctx.invoke(replay_command, trace_path=trace, method="nonshared,fullshared,kvcmas", qps=0.0,
                   num_warmups=num_warmups, result_dir=root, prime_method_state=True, logprobs=20, vllm_args=vllm_args)
    else:  # a loaded comparison runs each method alone (arms take turns single stream only)
        for method, name in (("nonshared", "nonshared"), ("fullshared", "fullshared"), ("kvcmas", "kvcmas"),
                             ("nonshared", AA_LABEL)):
            click.echo(f"[3/5] replay ({name})", err=True)
            ctx.invoke(replay_command, trace_path=trace, method=method, qps=qps, num_warmups=num_warmups,
                       result_dir=runs[name], label=name, vllm_args=vllm_args, prime_method_state=method == "kvcmas",
                       logprobs=20)
    click.echo(f"[3/5] replay ({FLOOR_LABEL}: without the shared context, PGR's floor)", err=True)
    ctx.invoke(replay_command, trace_path=trace, method="nonshared", qps=qps, num_warmups=num_warmups,
               result_dir=runs[FLOOR_LABEL], label=FLOOR_LABEL, vllm_args=vllm_args, drop_shared=True)
    click.echo("[4/5] quality against NonShared's outputs", err=True)
    ctx.invoke(quality_command, result_dirs=tuple(runs[n] for n in ("fullshared", "kvcmas", AA_LABEL, FLOOR_LABEL)),
               reference_dir=runs["nonshared"], floor_dir=runs[FLOOR_LABEL], naive_dir=runs["fullshared"])
    click.echo("[5/5] report", err=True)
    ctx.invoke(report_command, result_dirs=tuple(runs[n] for n in ("nonshared", "fullshared", "kvcmas", AA_LABEL)),
               out=root / "report",
               title=f"kvbench quickstart on {model}{constructed}{', vLLM eager' if enforce_eager else ''}, "
                     f"{shared_tokens} shared tokens, QPS {qps:g}: what NonShared, FullShared and KVCMAS save and cost")
