"""`kvbench replay`: its flags parsed into the calls of kvbench.experiment.replay, which composes the
run, and its summary printed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvbench import run_files
from kvbench.cli.inputs import check_method, key_values, load_trace
from kvbench.cli.instance_options import instance_options
from kvbench.cli.param_types import FiniteFloatRange, allow_code_execution_option, run_label
from kvbench.cli.run_notes import load_warning, measured_note
from kvbench.cli.server_options import ServerOptions, server_options
from kvbench.cli.workload_options import WorkloadOptions, workload_options
from kvbench.methods.api.spec import ChosenMethod
from kvbench.replay.interrupts import Interrupted
from kvbench.replay.protocol import PROTOCOLS
from kvbench.replay.routing import ROUTING_POLICIES
from kvbench.tracegen.arrivals import ARRIVAL_PROCESSES

if TYPE_CHECKING:
    from kvbench.server.instances import InstancePlan


@click.command("replay")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kvbench-trace file [default: a four-agent trace generated in memory].")
@click.option("--method", default="nonshared", show_default=True,
              help="KV sharing method (see `kvbench methods`), or several, comma-separated, compared at --qps 0: each "
                   "on a server of its own, all up side by side, taking turns a trajectory at a time in a rotating "
                   "order (--no-interleave: one after another), each run in --result-dir/<method>.")
@click.option("--interleave/--no-interleave", default=True, show_default=True,
              help="With several methods: take turns a trajectory at a time, so that drift on the machine falls on "
                   "every method alike; --no-interleave runs them one after another, one server at a time (less "
                   "memory, and a drift between them reads as a difference between methods).")
@click.option("--aa/--no-aa", default=True, show_default=True,
              help="With several methods: add the noise floor, NonShared a second time (nonshared-aa), taken in "
                   "turn like the rest: what identical methods differ by on this machine now.")
@click.option("--qps", type=FiniteFloatRange(min=0), default=1.0, show_default=True,
              help="Trajectory (whole workflow) arrivals per second, as in the paper's serving traces; "
                   "turns inside a trajectory start when their inputs are ready. 0 = single stream.")
@click.option("--arrival", type=click.Choice(ARRIVAL_PROCESSES), default="poisson", show_default=True,
              help="Arrival process for --qps.")
@click.option("--burstiness", type=FiniteFloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Gamma shape for --arrival gamma (1 = Poisson).")
@click.option("--use-trace-timestamps", is_flag=True, help="Replay the trace's own arrival_s (ignores --qps).")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="At most this many requests in flight (client-side queue time is recorded).")
@click.option("--prime-method-state", is_flag=True,
              help="Keep what the method learned during the warm-ups (anchor pools, calibrations): "
                   "measures its steady state instead of a cold start.")
@click.option("--metric-percentiles", default="50,90,99", show_default=True,
              help="Comma-separated percentiles reported as p{N}_{metric}_ms.")
@click.option("--goodput", "goodput_specs", multiple=True, metavar="KEY:MS",
              help="Latency bounds of goodput, as vllm bench serve's (repeatable, or several in one quoted value): "
                   "ttft, tpot, e2el per request, workflow for a trajectory's makespan; summary.json then gives "
                   "request_goodput and workflow_goodput (per second) and their shares.")
@click.option("--result-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where results go [default: results/<label|method>-<qps>qps-<time>].")
@click.option("--label", default=None, callback=run_label,
              help="Name of this run in reports (printable, no '/') [default: the method; `no-context` with "
                   "--drop-shared].")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Recorded in summary.json (repeatable).")
@click.option("--base-url", "base_urls", multiple=True, metavar="URL",
              help="Use running servers instead of starting one (repeatable; --routing picks each request's).")
@click.option("--routing", type=click.Choice(ROUTING_POLICIES), default="trajectory", show_default=True,
              help="With several servers (--instances, or several --base-url), where each request goes: trajectory "
                   "(a trajectory's turns on one server), agent (a trajectory's agents spread over the servers), "
                   "round-robin, cache-aware (the server holding most of its sources' tokens). A source on another "
                   "server is read through the shared tier, or prefilled where there is none.")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Port of the started server [default: free].")
@click.option("--resume", is_flag=True, help="Finish an interrupted run in --result-dir.")
@click.option("--request-timeout", type=FiniteFloatRange(min=0.1), default=600.0, show_default=True,
              help="Seconds before a request counts as failed.")
@click.option("--save-prompt-ids", is_flag=True,
              help="Store every prompt's token ids in requests.parquet and keep every turn's cache on the server, also "
                   "those no later turn reads (what KV-error measurements compare afterwards).")
@click.option("--temperature", type=FiniteFloatRange(min=0), default=0.0, show_default=True,
              help="Sampling temperature of every request (0: greedy, what quality comparisons need).")
@click.option("--top-p", type=FiniteFloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=-1), default=-1, show_default=True, help="-1: every token.")
@click.option("--reference", "reference_dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              default=None, help="A NonShared run of the same trace: later turns read its recorded outputs instead "
                                 "of this run's own (every prompt token-identical to its), and each output is "
                                 "compared with its (quality.parquet).")
@click.option("--protocol", type=click.Choice(list(PROTOCOLS)), default=None,
              help="free: each turn reads this run's outputs and decodes its whole output (decode load included); "
                   "paper: the KVCMAS paper's serving protocol (Appendix B.4): prompts carry --reference's outputs "
                   "and each request stops at its first token; paper-decode: those prompts, whole outputs (its "
                   "single-stream tables) [default: paper-decode with --reference, else free].")
@click.option("--logprobs", type=click.IntRange(min=0), default=None,
              help="Record the top-K logprobs of each first generated token (first-token KL against a reference; "
                   "vLLM serves up to 20) [default: 20 with --reference, else 0].")
@click.option("--drop-shared", is_flag=True,
              help="Leave every shared segment out of every prompt: the no-context floor of PGR.")
@click.option("--concurrent-sources/--no-concurrent-sources", default=True, show_default=True,
              help="A shared segment no earlier agent of the workflow holds (agents reading one document in "
                   "parallel) is read from the cache of a turn running at the same time that was sent first, as soon "
                   "as that turn's prompt is computed; --no-concurrent-sources: each such turn prefills it.")
@click.option("--stop-on-saturation/--no-stop-on-saturation", default=False, show_default=True,
              help="Stop a loaded run whose backlog and TTFT grow without bound (both slopes beyond noise, TTFT "
                   "doubled, after 20 s and 16 requests) and mark it saturated: its figures would measure how long it "
                   "ran, not the server (kvbench sweep: on by default).")
@workload_options({"num_trajectories": None, "num_warmups": 0, "seed": 0, "shared_tokens": 2048, "output_len": 128},
                  helps={"num_trajectories": "Replay only the first N trajectories (after warm-ups) [default: all; 10 for "
                                             "the in-memory trace]."})
@server_options
@instance_options
@allow_code_execution_option
def replay_command(trace_path: Path | None, method: str, interleave: bool, aa: bool, qps: float, arrival: str, burstiness: float,
                   use_trace_timestamps: bool, max_concurrency: int | None, prime_method_state: bool,
                   metric_percentiles: str, goodput_specs: tuple[str, ...], result_dir: Path | None, label: str | None,
                   metadata: tuple[str, ...], base_urls: tuple[str, ...], port: int | None, resume: bool,
                   request_timeout: float, save_prompt_ids: bool, temperature: float, top_p: float, top_k: int,
                   reference_dir: Path | None, protocol: str | None, logprobs: int | None, drop_shared: bool,
                   concurrent_sources: bool,
                   stop_on_saturation: bool, routing: str, workload: WorkloadOptions, server: ServerOptions,
                   instances: InstancePlan) -> None:
    """Replay a trace against vLLM: each agent's real output feeds the next agents' prompts."""
    from kvbench.analysis.goodput import parse_goodput
    from kvbench.analysis.metrics import parse_percentiles
    from kvbench.experiment.replay import ReplayInputError, replay_config, run_replay_experiment
    from kvbench.replay.result_lock import ResultDirError
    from kvbench.replay.run_config import ReplayError
    from kvbench.replay.sampling import SamplingParams
    from kvbench.replay.saturation import SaturationRule
    from kvbench.server.errors import ServerError

    try:
        percentiles = parse_percentiles(metric_percentiles)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--metric-percentiles") from None
    try:
        goodput = parse_goodput(goodput_specs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--goodput") from None
    methods = [m.strip() for m in method.split(",") if m.strip()]
    if len(methods) > 1:
        compared = _check_comparison(methods, server, qps, use_trace_timestamps, base_urls, label, instances, drop_shared)
    else:
        chosen = check_method(method, server.method_params)
    if instances.instances > 1 and (base_urls or port is not None):
        raise click.UsageError("--instances starts its servers on free ports: give --instances, or --base-url/--port")
    if resume and result_dir is None:
        raise click.UsageError("--resume needs the --result-dir of the run to finish")
    if top_k == 0:
        raise click.BadParameter("0 is not a number of tokens; -1 keeps every token", param_hint="--top-k")
    trace, tokenizer, model = load_trace(trace_path, server.model, workload)
    if (note := measured_note(len(trace.trajectories), workload.num_warmups)) is not None:
        click.echo(note, err=True)

    def make_config(method: ChosenMethod, label: str | None, result_dir: Path | None) -> Any:
        return replay_config(
            trace, tokenizer, model, method, base_urls=list(base_urls), result_dir=result_dir, label=label,
            reference_dir=reference_dir, protocol=protocol, trace_path=trace_path,
            max_load_tokens_per_step=server.max_load_tokens_per_step,
            qps=qps, arrival=arrival, burstiness=burstiness, use_trace_timestamps=use_trace_timestamps,
            seed=workload.seed, max_concurrency=max_concurrency, num_warmups=workload.num_warmups,
            prime_method_state=prime_method_state, metric_percentiles=percentiles, goodput=goodput,
            metadata=key_values(metadata, "--metadata"), drop_shared=drop_shared,
            sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
            concurrent_sources=concurrent_sources, routing=routing, logprobs=logprobs, request_timeout_s=request_timeout,
            save_prompt_ids=save_prompt_ids, resume=resume,
            saturation=SaturationRule() if stop_on_saturation else None)

    if len(methods) > 1:
        from datetime import datetime

        from kvbench.cli.method_comparison import compare_methods

        root = result_dir or Path("results") / f"compare-{datetime.now():%Y%m%d-%H%M%S}"
        compare_methods(compared, root, aa, interleave, make_config,
                        lambda m, log: server.server_config(m, model, log_path=log, lora_modules=trace.header.adapters),
                        cpu_kv_cache_gib=server.cpu_kv_cache_gib, model=model)
        return
    try:
        config = make_config(chosen, label, result_dir)
    except ReplayInputError as exc:
        if exc.option is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    result_dir = config.output.result_dir

    def server_config(log_path: Path) -> Any:
        return server.server_config(chosen, model, port=port, log_path=log_path,
                                    lora_modules=trace.header.adapters)

    try:
        summary = run_replay_experiment(
            config, None if base_urls else server_config,
            announce=lambda c: click.echo(f"starting {instances.instances} vLLM instance(s) ({method}) for {model} ... "
                                          f"logs: {c.log_path.parent}", err=True),
            on_note=lambda note: click.echo(f"note: {note}", err=True), instances=instances)
    except (ServerError, ReplayError, ResultDirError) as exc:
        raise click.ClickException(str(exc)) from None
    except Interrupted:
        if (result_dir / run_files.SUMMARY).exists():
            click.echo(f"stopped: the requests in flight are recorded as interrupted and the summary is written in "
                       f"{result_dir}; finish the run with --resume --result-dir {result_dir}", err=True)
        raise
    print_summary(summary, qps_given=click.get_current_context().get_parameter_source("qps")
                  != click.core.ParameterSource.DEFAULT)
    if reference_dir is not None:
        from kvbench.replay.reference import comparison_caveats, read_run_config

        for caveat in comparison_caveats(summary["config"], read_run_config(reference_dir)):
            click.echo(f"warning: against the reference {reference_dir}, {caveat}", err=True)
    click.echo(f"results: {result_dir}")
    _report_failures(result_dir, summary)


def _check_comparison(methods: list[str], server: ServerOptions, qps: float, use_trace_timestamps: bool,
                      base_urls: tuple[str, ...], label: str | None, instances: InstancePlan,
                      drop_shared: bool) -> list[ChosenMethod]:
    """A comparison of several methods runs each on a server it starts, single stream, with its
    defaults: the methods resolved."""
    compared = [check_method(name, ()) for name in methods]
    if len(set(methods)) != len(methods):
        raise click.BadParameter(f"{','.join(methods)} names a method twice", param_hint="--method")
    refused = [(server.method_params, "--method-param (each method runs with its defaults: compare parameters with "
                                      "`kvbench sweep`)"),
               (qps > 0 or use_trace_timestamps, "--qps above 0 or --use-trace-timestamps (methods take turns a "
                                                 "trajectory at a time, single stream; loaded comparisons: kvbench sweep)"),
               (base_urls, "--base-url (each method runs on a server of its own, started here)"),
               (label, "--label (each run is labelled by its method)"), (instances.instances > 1, "--instances"),
               (drop_shared, "--drop-shared")]
    for given, what in refused:
        if given:
            raise click.UsageError(f"--method {','.join(methods)} compares several methods: it takes no {what}")
    return compared


def _report_failures(result_dir: Path, summary: dict[str, Any]) -> None:
    """Like `vllm bench serve`: show the first errors; a run where nothing succeeded fails."""
    if not summary["failed"]:
        return
    import pandas as pd

    requests = pd.read_parquet(result_dir / run_files.REQUESTS)
    failed = requests[~requests["success"]]
    click.echo(f"{summary['failed']} requests failed; by type: {failed['error_type'].value_counts().to_dict()}", err=True)
    for _, row in failed[failed["error_type"] != "dependency_failed"].head(10).iterrows():
        click.echo(f"  {row['trajectory_id']}/{row['turn_id']}: {row['error_type']}: {row['error_message']}", err=True)
    if summary["completed"] == 0:
        raise click.ClickException("every request failed (see the errors above)")


def saturation_note(summary: dict[str, Any]) -> str:
    """What a saturated run's summary says about it, in a line."""
    from kvbench.replay.saturation import SaturationVerdict

    verdict = SaturationVerdict(**summary["saturation"]) if summary.get("saturation") else None
    stopped = summary.get("saturation_stopped_requests") or 0
    return ((verdict.describe() if verdict else "over-saturated") + f"; the run stopped there ({stopped} requests in "
            "flight left unanswered): its figures describe a growing queue, not a steady state. Use a lower --qps.")


COLD_START_WARN_SHARE = 0.25  # of segment decisions: below it, warming up would change little


def print_summary(summary: dict[str, Any], qps_given: bool = True) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvbench.analysis.metric_catalog import console_rows
    from kvbench.analysis.metrics import percentile_key

    qps = f"{summary['request_rate']:g} QPS" + ("" if qps_given else " (the default: --qps sets it)")
    table = Table(title=f"kvbench replay: {summary['method']} @ {qps}", show_header=False)
    # the catalog's console metrics in its order (a family: the run's mean, median and percentiles)
    rows = console_rows(summary, ["mean", "median", *(percentile_key(p) for p in summary["config"]["metric_percentiles"])])
    if summary.get("goodput_slo"):
        rows.append(("Goodput bounds (ms)", " ".join(f"{key}:{bound:g}" for key, bound in summary["goodput_slo"].items())))
    sampling = summary["config"].get("sampling")
    if sampling:
        rows.append(("Sampling", "greedy" if sampling.get("greedy") else
                     f"temperature {sampling['temperature']:g}, top_p {sampling['top_p']:g}, top_k {sampling['top_k']}"))
    for label, value in rows:
        table.add_row(label, value)
    Console().print(table)
    if summary.get("saturated"):
        Console(stderr=True).print(f"[red]saturated:[/] {saturation_note(summary)}")
    if (warning := load_warning(summary)) is not None:
        Console(stderr=True).print(f"[yellow]loaded machine:[/] {warning}")
    if (warning := cold_start_warning(summary)) is not None:
        Console(stderr=True).print(f"[yellow]note:[/] {warning}")


def cold_start_warning(summary: dict[str, Any]) -> str | None:
    """What to say when a run's reuse is low because the method started cold (issue 51)."""
    share = summary.get("cold_start_dense_share")
    if share is None or share < COLD_START_WARN_SHARE:
        return None
    config = summary.get("config") or {}
    warmups = int(config.get("num_warmups") or 0)
    primed = bool(config.get("prime_method_state")) and warmups > 0
    rho = summary.get("realized_rho")
    needed = summary.get("cold_start_trajectories")
    text = (f"{share:.0%} of the method's segment decisions went dense because its anchor pools were still empty "
            f"(a cold start{f', even after {warmups} primed warm-ups' if primed else ''}); realized rho "
            f"{'-' if rho is None else f'{rho:.2f}'} is the cold-start figure.")
    if needed:  # what this run saw: the pools still empty through its `needed`-th measured trajectory
        advice = f"--num-warmups {warmups + needed}" + ("" if config.get("prime_method_state") else " --prime-method-state")
        text += (f" Decisions went dense for want of anchors up to measured trajectory {needed} (in arrival order), "
                 f"so this trace needs about {warmups + needed} warm-ups: {advice} measures the steady state (the "
                 "paper's).")
    elif not primed:
        text += " --num-warmups N --prime-method-state measures the steady state (the paper's)."
    return text


