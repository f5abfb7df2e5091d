"""A table as markdown the way every kvbench report prints one: shares (metric catalog) with
three decimals, other numbers in the table's format, and a missing figure as a dash, never `nan`."""

from __future__ import annotations

import re

import pandas as pd

from kvbench.analysis import metric_catalog

# What a user's string could mark up in Markdown (emphasis, links and images, HTML, tables, code,
# entities): each escaped with a backslash, as CommonMark allows for any ASCII punctuation.
_MARKUP = re.compile(r"([\\`*_\[\]<>!|&])")
# Columns that hold a user's strings (labels, folder names, model names, agent names) in full.
TEXT_COLUMNS = frozenset({"run", "cell", "method", "model", "agent", "label"})

NOT_MEASURED = "-"  # a figure this run has not (no reference, no task, no connector): said in the legend


def md_text(value: object) -> str:
    """A user's string (a label, a path, a title, a model's name) as Markdown text that marks up
    nothing: every markup character escaped, line breaks as spaces."""
    return _MARKUP.sub(r"\\\1", " ".join(str(value).split()))


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".1f") -> str:
    """The table with each number in its column's format and every missing figure a dash, not `nan`;
    user strings (TEXT_COLUMNS, the headers) as text, and no cell able to add a column (`|`)."""
    shown = pd.DataFrame(index=frame.index)
    for column in frame.columns:
        # shares and scores (0..1) keep three decimals in every table, so a figure reads the same in each
        fmt = ".3f" if metric_catalog.is_share(column) else floatfmt
        text = md_text if column in TEXT_COLUMNS else _cell
        header = column if re.fullmatch(r"[\w.]+", str(column)) else md_text(column)  # metric keys as they are
        shown[header] = [NOT_MEASURED if _missing(v) else format(v, fmt) if isinstance(v, float) else text(v)
                                  for v in frame[column]]
    align = ["right" if pd.api.types.is_numeric_dtype(frame[c]) else "left" for c in frame.columns]
    if len(set(shown.columns)) < len(frame.columns):
        raise ValueError(f"two columns read the same once escaped: {list(frame.columns)}")
    return shown.to_markdown(index=False, disable_numparse=True, colalign=align)


def _cell(value: object) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and value != value)  # NaN


