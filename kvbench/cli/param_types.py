"""Option types shared by the commands."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

from kvbench.tracegen.tasks.sandbox.code_execution import CONSENT_ENV, CodeExecutionRefused, require_code_execution

F = TypeVar("F", bound=Callable[..., Any])


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and infinity: click's bounds let nan through (every
    comparison with it is false) and an unbounded side lets inf through, and neither means
    anything as a rate, a timeout or a budget."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


MAX_LABEL_CHARS = 100


def run_label(ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> str | None:
    """A run's --label, checked up front: it names the run's folder, its rows in every report and
    its requests' ids (HTTP headers), so printable characters only (no line break or control
    character), no path separator, at most MAX_LABEL_CHARS."""
    if value is None:
        return None
    if not value.strip() or not value.isprintable() or "/" in value or len(value) > MAX_LABEL_CHARS:
        raise click.BadParameter(f"{value!r}: a label is 1 to {MAX_LABEL_CHARS} printable characters, without "
                                 "line breaks, control characters or '/'")
    return value


def finite_float(text: str) -> float:
    """float() for list options: nan and infinity refused as not finite."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not finite")
    return number


def role_paths(specs: Iterable[str], option: str = "--adapter", key: str = "ROLE") -> dict[str, str]:
    """`KEY=PATH` options (gen-trace's and sweep's --adapter ROLE=PATH, serve's --lora-modules) as a map."""
    paths = {}
    for spec in specs:
        role, sep, path = str(spec).partition("=")
        if not sep or not role or not path:
            raise click.BadParameter(f"expected {key}=PATH, got {spec!r}", param_hint=option)
        paths[role] = path
    return paths


def allow_code_execution_option(func: F) -> F:
    """`--allow-code-execution`: consent to run model-written code (HumanEval's tests), in the sandbox."""
    def consent(_ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value:
            os.environ[CONSENT_ENV] = "1"  # read where the checks run, in this process and its children

    return click.option("--allow-code-execution", is_flag=True, expose_value=False, callback=consent,
                        help=f"Run model-written code: HumanEval's tests of each completion, each in a bubblewrap "
                             f"sandbox [also: {CONSENT_ENV}=1].")(func)


def require_code_execution_here() -> None:
    """Refuse at once, before any server starts, when HumanEval would be scored without consent
    or without a sandbox."""
    try:
        require_code_execution()
    except CodeExecutionRefused as exc:
        raise click.ClickException(str(exc)) from None


def option_group(options: list[Callable[[Any], Any]], names: tuple[str, ...], build: Callable[..., Any],
                 argument: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding `options` to a click command, which receives the values of `names` as one
    argument `argument`, `build(**values)` (e.g. ServerOptions): a new option is added in one place."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def with_options(**kwargs: Any) -> Any:
            return command(**{argument: build(**{name: kwargs.pop(name) for name in names})}, **kwargs)

        for option in reversed(options):
            with_options = option(with_options)
        return with_options

    return decorate
