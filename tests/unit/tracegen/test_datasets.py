"""Benchmark items read from the files a user has (tracegen/datasets.py), on kvbench's own fixtures."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from paths import DATA

from kvbench.tracegen.datasets import DatasetError, TaskItem
from kvbench.tracegen.tasks.registry import get_task


def read_items(task: str, path: Path, limit: int | None = None, seed: int | None = None) -> list[TaskItem]:
    """A benchmark task's items from `path` (the task module reads its rows)."""
    return get_task(task).items(str(path), limit, seed)  # type: ignore[attr-defined]


def test_gsm8k_gold_is_the_number_after_the_marker() -> None:
    items = read_items("gsm8k", DATA / "gsm8k-sample.jsonl")
    assert [item.gold for item in items][:3] == ["22", "120", "2875"]  # thousands separators dropped
    assert items[0].question.startswith("A baker fills 6 trays") and items[0].item_id == "gsm8k-0"


def test_mmlu_questions_carry_lettered_choices_and_a_letter_gold() -> None:
    items = read_items("mmlu", DATA / "mmlu-sample.parquet")
    assert [item.gold for item in items][:3] == ["B", "A", "D"]
    assert items[0].question.splitlines()[-4:] == ["A. Venus", "B. Mercury", "C. Mars", "D. Earth"]
    assert items[1].subject == "college_mathematics"


def test_humaneval_items_keep_their_tests_from_a_gzipped_file(tmp_path: Path) -> None:
    packed = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as out:
        out.write((DATA / "humaneval-sample.jsonl").read_text())
    items = read_items("humaneval", packed)
    assert [item.item_id for item in items] == ["KVBench/0", "KVBench/1"]
    assert items[0].question.startswith("def count_vowels") and items[0].entry_point == "count_vowels"
    assert items[0].test is not None and "def check(candidate)" in items[0].test


def test_limit_takes_the_first_items_or_a_seeded_sample_in_file_order() -> None:
    assert [i.gold for i in read_items("gsm8k", DATA / "gsm8k-sample.jsonl", limit=2)] == ["22", "120"]
    first = [i.item_id for i in read_items("gsm8k", DATA / "gsm8k-sample.jsonl", limit=2)]
    samples = {seed: [i.item_id for i in read_items("gsm8k", DATA / "gsm8k-sample.jsonl", limit=2, seed=seed)]
               for seed in range(6)}
    assert samples[3] == [i.item_id for i in read_items("gsm8k", DATA / "gsm8k-sample.jsonl", limit=2, seed=3)]
    assert len({tuple(s) for s in samples.values()}) > 1  # the seed changes the sample
    assert any(sample != first for sample in samples.values())  # a sample, not the first items
    for sample in samples.values():
        assert sample == sorted(sample, key=lambda item_id: int(item_id.split("-")[1]))  # in file order


@pytest.mark.parametrize("task, row, message", [
    ("gsm8k", {"question": "q"}, "row 1: answer: missing (a gsm8k row needs question, answer; found question)"),
    ("gsm8k", {"question": "q", "answer": "no marker"}, "row 1: answer: no '#### <number>' marker"),
    ("mmlu", {"question": "q", "choices": ["a", "b"], "answer": 0}, "row 1: choices: 2 of them, MMLU has 4"),
    ("mmlu", {"question": "q", "choices": ["a", "b", "c", "d"], "answer": 7}, "row 1: answer: 7 is neither"),
    ("humaneval", {"task_id": "t", "prompt": "p", "test": "t"}, "row 1: entry_point: missing"),
])
def test_a_malformed_row_is_refused_with_its_row_and_field(task: str, row: dict, message: str, tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_items(task, path)  # type: ignore[arg-type]


def test_unreadable_files_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(DatasetError, match="bad.jsonl: line 1: not JSON"):
        read_items("gsm8k", tmp_path / "bad.jsonl")
    with pytest.raises(DatasetError, match="cannot read"):
        read_items("gsm8k", tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown task 'squad'"):
        read_items("squad", tmp_path / "bad.jsonl")  # type: ignore[arg-type]
