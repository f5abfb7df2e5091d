"""A table as markdown the way every kvbench report prints one: shares (metric catalog) with
three decimals, other numbers in the table's format, and a missing figure as a dash, never `nan`."""

from __future__ import annotations

import pandas as pd

from kvbench.analysis import metric_catalog

NOT_MEASURED = "-"  # a figure this run has not (no reference, no task, no connector): said in the legend


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".1f") -> str:
    """The table with each number in its column's format and every missing figure a dash, not `nan`."""
    shown = pd.DataFrame(index=frame.index)
    for column in frame.columns:
        # shares and scores (0..1) keep three decimals in every table, so a figure reads the same in each
        fmt = ".3f" if metric_catalog.is_share(column) else floatfmt
        shown[column] = [NOT_MEASURED if _missing(v) else format(v, fmt) if isinstance(v, float) else str(v)
                         for v in frame[column]]
    align = ["right" if pd.api.types.is_numeric_dtype(frame[c]) else "left" for c in frame.columns]
    return shown.to_markdown(index=False, disable_numparse=True, colalign=align)


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and value != value)  # NaN


