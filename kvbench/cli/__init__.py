"""The `kvbench` command line: thin click wrappers over the kvbench packages."""

from __future__ import annotations

import click

from kvbench import __version__
from kvbench.cli.analysis import (
    compare_command,
    leaderboard_command,
    profile_command,
    quality_command,
    report_command,
    score_command,
    summarize_command,
)
from kvbench.cli.calibrate import calibrate_command
from kvbench.cli.check import check_command
from kvbench.cli.model import model_group
from kvbench.cli.paper import paper_command
from kvbench.cli.quickstart import quickstart_command
from kvbench.cli.replay import replay_command
from kvbench.cli.serve import methods_command, serve_command
from kvbench.cli.sweep import sweep_command
from kvbench.cli.trace import gen_trace_command, trace_group
from kvbench.cli.vllm_cli import vllm_command


class KVBenchGroup(click.Group):
    """SIGINT and SIGTERM stop any command cleanly: they raise `Interrupted` in the main thread,
    so a server a command started is shut down on the way out, and the exit status is
    128 + the signal's number (130, 143), as shells and CI runners expect."""

    def invoke(self, ctx: click.Context) -> object:
        from kvbench.replay.interrupts import Interrupted, raise_on_stop_signals

        try:
            with raise_on_stop_signals():
                return super().invoke(ctx)
        except Interrupted as exc:
            click.echo(f"kvbench: {exc}", err=True)
            raise click.exceptions.Exit(exc.exit_code) from None


@click.group(cls=KVBenchGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvbench")
def main() -> None:
    """Benchmark cross-agent KV-cache sharing methods inside a real vLLM server.

    Data flows one way: gen-trace -> replay -> report.
    """


main.add_command(model_group)
main.add_command(gen_trace_command)
main.add_command(trace_group)
main.add_command(replay_command)
main.add_command(serve_command)
main.add_command(methods_command)
main.add_command(calibrate_command)
main.add_command(check_command)
main.add_command(quickstart_command)
main.add_command(report_command)
main.add_command(quality_command)
main.add_command(leaderboard_command)
main.add_command(compare_command)
main.add_command(summarize_command)
main.add_command(profile_command)
main.add_command(score_command)
main.add_command(sweep_command)
main.add_command(paper_command)
main.add_command(vllm_command)
