"""Option types shared by the commands."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and infinity: click's bounds let nan through (every
    comparison with it is false) and an unbounded side lets inf through, and neither means
    anything as a rate, a timeout or a budget."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def finite_float(text: str) -> float:
    """float() for list options: nan and infinity refused as not finite."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text!r} is not finite")
    return number
