"""The workload options of the commands that generate their trace in memory (or cut a --trace to
its first trajectories): declared once here, each command choosing its defaults, and gathered
into one value (`WorkloadOptions`), as the server options are (kvbench.cli.server_options)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from kvbench.tracegen.schema import MAX_OUTPUT_TOKENS, MAX_SEGMENT_TOKENS


@dataclass(frozen=True)
class WorkloadOptions:
    num_trajectories: int | None  # None: all of a --trace's (10 for the in-memory trace)
    num_warmups: int
    shared_tokens: int
    output_len: int
    seed: int


_DECLARATIONS: dict[str, tuple[str, Callable[[int], click.ParamType], str]] = {
    # name: (flag, type from the smallest value allowed, help)
    "num_trajectories": ("--num-trajectories", lambda low: click.IntRange(min=low),
                         "Trajectories replayed (after the warm-ups)."),
    "num_warmups": ("--num-warmups", lambda low: click.IntRange(min=low),
                    "Trajectories run first, single stream, and left out of the results."),
    "shared_tokens": ("--shared-tokens", lambda low: click.IntRange(min=low, max=MAX_SEGMENT_TOKENS),
                      "Shared context of the in-memory trace (ignored with --trace)."),
    "output_len": ("--output-len", lambda low: click.IntRange(min=low, max=MAX_OUTPUT_TOKENS),
                   "Agent output length of the in-memory trace (ignored with --trace)."),
    "seed": ("--seed", lambda low: click.INT, "Seed of the in-memory trace and of the arrival schedule."),
}
_LOWEST = {"num_trajectories": 1, "num_warmups": 0, "shared_tokens": 1, "output_len": 1, "seed": 0}
# What a command that does not take an option gets for it.
_ABSENT = {"num_trajectories": None, "num_warmups": 0, "shared_tokens": 2048, "output_len": 128, "seed": 0}


def workload_options(defaults: dict[str, int | None], helps: dict[str, str] | None = None,
                     lowest: dict[str, int] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the workload options named in `defaults` (with those defaults; `helps` replaces a help
    text, `lowest` raises a smallest value) to a click command, which receives them as one
    `workload` argument; an option a command does not take is its default there."""
    unknown = set(defaults) - set(_DECLARATIONS)
    if unknown:
        raise ValueError(f"unknown workload option(s): {', '.join(sorted(unknown))}")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def with_options(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name, _ABSENT[name]) for name in _DECLARATIONS}
            return command(workload=WorkloadOptions(**values), **kwargs)

        for name in reversed(list(defaults)):
            flag, kind, text = _DECLARATIONS[name]
            low = (lowest or {}).get(name, _LOWEST[name])
            with_options = click.option(flag, name, type=kind(low), default=defaults[name],
                                        show_default=defaults[name] is not None,
                                        help=(helps or {}).get(name, text))(with_options)
        return with_options

    return decorate
