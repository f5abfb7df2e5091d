"""Benchmark files a user already has (nothing is downloaded at run time): the Hugging Face
datasets' parquet or JSONL exports and HumanEval's own JSONL(.gz), read into rows. Which columns
a task needs and what it makes of a row are the task's (kvbench.tracegen.tasks: mmlu, gsm8k,
humaneval). A row that lacks a column is refused with the file, the row and the field, like
`kvbench trace validate`.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A benchmark file kvbench cannot read; the message names the file, row and field."""


@dataclass(frozen=True)
class TaskItem:
    """One benchmark item: what every agent reads, and what scoring compares the answer with."""

    item_id: str
    question: str  # the shared segment: the question (MMLU: with its lettered choices; HumanEval: the prompt)
    gold: str  # GSM8K: the number; MMLU: the letter; HumanEval: the task id (scored by running `test`)
    test: str | None = None  # HumanEval: the `check` function of the item's tests
    entry_point: str | None = None  # HumanEval: the function `check` is called with
    subject: str | None = None  # MMLU


def _rows(path: Path) -> list[dict[str, Any]]:
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            import pandas as pd

            return [dict(row) for row in pd.read_parquet(path).to_dict(orient="records")]
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as handle:
            rows = []
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}: line {number}: not JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}: line {number}: a row must be a JSON object")
                rows.append(row)
            return rows
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc}") from None


def read_rows(path: str | Path, task: str, columns: Sequence[str], limit: int | None = None,
              seed: int | None = None) -> list[tuple[dict[str, Any], int, str]]:
    """The rows of a benchmark file, each with its index and where it is (for errors): all of
    them, or `limit` of them (the first ones, or a sample drawn with `seed`, kept in file order).
    A row without one of `columns` is refused, naming the file, the row and the column."""
    path = Path(path)
    rows = _rows(path)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    indices = list(range(len(rows)))
    if limit is not None and limit < len(rows):
        indices = sorted(random.Random(seed).sample(indices, limit)) if seed is not None else indices[:limit]
    found = []
    for i in indices:
        row, where = rows[i], f"{path}: row {i + 1}"
        missing = [column for column in columns if row.get(column) is None]
        if missing:
            raise DatasetError(f"{where}: {', '.join(missing)}: missing (a {task} row needs "
                               f"{', '.join(columns)}; found {', '.join(sorted(row)) or 'nothing'})")
        found.append((row, i, where))
    return found
