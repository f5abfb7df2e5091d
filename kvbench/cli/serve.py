"""`kvbench serve` (a server running a method, for other clients) and `kvbench methods`."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvbench.cli.inputs import check_method
from kvbench.cli.instance_options import instance_options
from kvbench.cli.param_types import role_paths
from kvbench.cli.server_options import ServerOptions, server_options
from kvbench.methods.api.spec import ChosenMethod
from kvbench.replay.interrupts import Interrupted

if TYPE_CHECKING:
    from kvbench.server.instances import InstancePlan


@click.command("serve")
@click.option("--method", default="nonshared", show_default=True, help="KV sharing method the server runs.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--log", "log_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="vLLM's log [default: results/serve/<method>-<port>.log under the current folder; with "
                   "--instances, the folder of their logs, results/serve/<method>/].")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=PATH",
              help="A LoRA adapter to serve (PEFT folder; repeatable), as vLLM's --lora-modules: requests name it as "
                   "their model, and the connector applies it to the rows it computes (V-only adapters).")
@server_options
@instance_options
def serve_command(method: str, host: str, port: int, log_path: Path | None, lora_modules: tuple[str, ...],
                  server: ServerOptions, instances: InstancePlan) -> None:
    """Start a vLLM server running a method, for other clients (Ctrl-C stops it); with --instances N,
    N of them and the Mooncake master they share caches through (replay against them with one
    --base-url per instance)."""
    import time

    from kvbench.model.resolve import resolve_model
    from kvbench.server.errors import ServerError
    from kvbench.server.lifecycle import VLLMServer

    chosen = check_method(method, server.method_params)
    if instances.grouped:
        _serve_group(chosen, host, port, log_path, server, instances)
        return
    log_path = log_path or Path("results") / "serve" / f"{method}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    adapters = {name: str(Path(path).resolve()) for name, path in role_paths(lora_modules, "--lora-modules", "NAME").items()}
    config = server.server_config(chosen, resolve_model(server.model), host=host, port=port,
                                  log_path=log_path.resolve(), lora_modules=adapters)
    click.echo(f"starting vLLM ({method}) for {config.model} on {host}:{port} (a start takes a minute or two "
               f"on a CPU) ... log: {config.log_path}", err=True)
    try:
        with VLLMServer(config) as running:
            click.echo(json.dumps({"base_url": running.base_url, "method": method, "model": config.model,
                                   "log": str(running.log_path)}))
            while running.is_running():
                time.sleep(1)
            raise click.ClickException(f"the vLLM server exited with code {running.process.returncode}; "
                                       f"log: {running.log_path}")
    except ServerError as exc:
        raise click.ClickException(str(exc)) from None
    except Interrupted as exc:  # the normal way to stop a server: exit 0, like vLLM's own
        click.echo(f"stopped ({signal.Signals(exc.signum).name}); the server is shut down", err=True)


def _serve_group(chosen: ChosenMethod, host: str, port: int, log_path: Path | None, server: ServerOptions,
                 instances: InstancePlan) -> None:
    """`serve --instances N`: the instances on free ports (one alone on --port), their logs in one folder."""
    import time

    from kvbench.model.resolve import resolve_model
    from kvbench.server.errors import ServerError
    from kvbench.server.instances import ServerGroup

    method = chosen.name
    log_dir = (log_path or Path("results") / "serve" / method).resolve()
    config = server.server_config(chosen, resolve_model(server.model), host=host, port=port)
    click.echo(f"starting {instances.instances} vLLM instances ({method}) for {config.model} ... logs: {log_dir}", err=True)
    try:
        with ServerGroup(config, instances, log_dir) as group:
            click.echo(json.dumps({"base_urls": group.base_urls, "method": method, "model": config.model,
                                   "logs": str(log_dir), "pids": group.pids, **group.describe()}), nl=True)
            sys.stdout.flush()
            while (failure := group.failure()) is None:
                time.sleep(1)
            raise click.ClickException(failure)
    except ServerError as exc:
        raise click.ClickException(str(exc)) from None
    except Interrupted as exc:
        click.echo(f"stopped ({signal.Signals(exc.signum).name}); the instances and the master are shut down", err=True)


@click.command("methods")
@click.option("--markdown", is_flag=True, help="One markdown table (the README's and docs' method table).")
def methods_command(markdown: bool) -> None:
    """List the KV sharing methods: what each does and its parameters (set with --method-param)."""
    from kvbench.methods.registry import all_methods, methods_table

    if markdown:
        click.echo(methods_table())
        return
    for name, cls in all_methods().items():
        click.echo(f"{name:20s} {'exact' if not cls.approximate else 'approximate'}: {cls.summary}")
        for param, default, description in cls.Params.describe():
            click.echo(f"{'':22s}{param}={default}  {description}")
