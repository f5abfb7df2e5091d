"""`kvbench check`: does every method do what it claims, on this hardware and this model?"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click

from kvbench.cli.server_options import ServerOptions, server_options
from kvbench.cli.workload_options import WorkloadOptions, workload_options


@click.command("check")
@click.option("--methods", default=None, metavar="M1,M2,...",
              help="Methods to check [default: every method with an invariant, or those the --base-url servers run].")
@click.option("--base-url", "base_urls", multiple=True, metavar="URL",
              help="A running kvbench server to check (repeatable; each runs one method, read from it). Methods "
                   "without one get a server started here.")
@click.option("--output", "output_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("results/kvbench-check.json"), show_default=True,
              help="Where the verdicts go (JSON); the logs of the servers started go to a folder beside it "
                   "(kvbench-check-logs/).")
@workload_options({"shared_tokens": 512, "output_len": 16, "num_trajectories": 4, "seed": 0},
                  helps={"shared_tokens": "Shared-query tokens of each check trajectory.",
                         "output_len": "Tokens each agent generates (greedy) and the outputs compared.",
                         "num_trajectories": "Two-agent trajectories per invariant (KVCMAS accepts its first match in "
                                             "the third)."},
                  lowest={"shared_tokens": 16, "num_trajectories": 3})
@server_options
def check_command(methods: str | None, base_urls: tuple[str, ...], output_path: Path, workload: WorkloadOptions,
                  server: ServerOptions) -> None:
    """Check each method against what it must equal exactly (a few minutes; exit 1 unless all pass).

    FullShared reading an agent's own cache gives NonShared's outputs, its re-aligned layer-0 keys a
    dense prefill's; KVCMAS and KVComm with their gates forced dense, CacheBlend recomputing every
    token and DroidSpeak every layer give NonShared's outputs and K/V; KVCMAS accepting matches with
    no correction added and PolyKV with its identity codec place FullShared's K/V; PReCache with
    identity adapters gives the base model's outputs. Run it first on a new GPU or model."""
    from kvbench.experiment.check_requests import CheckedServer, CheckSpec
    from kvbench.experiment.invariants import invariants_of
    from kvbench.experiment.method_check import check_report, run_checks
    from kvbench.model.resolve import resolve_model
    from kvbench.server.errors import ServerError

    if server.method_params:
        raise click.UsageError("kvbench check sets each method's parameters itself: drop --method-param")
    served = {}
    for url in base_urls:
        try:
            served[CheckedServer(url).method] = url.rstrip("/")
        except (OSError, ValueError, KeyError) as exc:
            raise click.ClickException(f"cannot read which method {url} runs ({exc}): is it a server kvbench "
                                       "started (kvbench serve --method M)?") from None
    chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods else list(served)
    try:
        invariants = invariants_of(chosen) if chosen else invariants_of(_all_checked())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    spec = CheckSpec(model=resolve_model(server.model), shared_tokens=workload.shared_tokens,
                     output_len=workload.output_len, trajectories=workload.num_trajectories or 4, seed=workload.seed)
    with tempfile.TemporaryDirectory(prefix="kvbench-check-") as scratch:
        logs = output_path.resolve().parent / f"{output_path.stem}-logs"  # one vLLM log per server started

        @contextlib.contextmanager
        def server_for(method: str) -> Iterator[str]:
            from kvbench.experiment.servers import server_url
            from kvbench.methods.registry import resolve_method

            def config() -> object:
                logs.mkdir(parents=True, exist_ok=True)
                adapters = _identity_adapters(spec.model, Path(scratch)) if method.startswith("precache") else {}
                click.echo(f"starting vLLM ({method}) for {spec.model} ... log: {logs / f'check-{method}.log'}", err=True)
                return server.server_config(resolve_method(method), spec.model, log_path=logs / f"check-{method}.log",
                                            lora_modules=adapters)
            with server_url(served.get(method), config) as url:  # type: ignore[arg-type]
                yield url

        try:
            outcomes = run_checks(spec, invariants, server_for, progress=lambda line: click.echo(line, err=True))
        except (ServerError, ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
    report = check_report(spec, outcomes, model_name=server.model)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    output_path.write_text(json.dumps(report, indent=2) + "\n")
    _print_table(report)
    click.echo(f"verdicts: {output_path}")
    if not report["passed"]:
        raise click.exceptions.Exit(1)


def _all_checked() -> list[str]:
    from kvbench.experiment.invariants import INVARIANTS

    return list(dict.fromkeys(i.method for i in INVARIANTS))


def _identity_adapters(model: str, folder: Path) -> dict[str, str]:
    """The V-only identity adapters (B = 0) PReCache's invariant serves, one per check agent."""
    from kvbench.experiment.check_requests import ADAPTER_PREFIX
    from kvbench.model.adapters import build_random_adapter

    adapters = {}
    for index in range(2):
        path = folder / f"{ADAPTER_PREFIX}{index}"
        if not path.exists():
            build_random_adapter(model, path, zero=True)
        adapters[f"{ADAPTER_PREFIX}{index}"] = str(path)
    return adapters


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvbench check: {report['model_identity'] or report['model']}")
    for column in ("method", "invariant", "result", "turns", "evidence"):
        table.add_column(column, overflow="fold")
    styles = {"pass": "green", "fail": "bold red", "skipped": "yellow"}
    for outcome in report["outcomes"]:
        status = outcome["status"]
        table.add_row(outcome["method"], outcome["invariant"], f"[{styles[status]}]{status}[/]", str(outcome["turns"]),
                      outcome["evidence"])
    Console(width=160).print(table)
