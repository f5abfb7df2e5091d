"""Scoring benchmark workloads: answers read strictly, HumanEval run with its tests in a guarded process."""

from __future__ import annotations

import uuid
from pathlib import Path

import pandas as pd
import pytest

from kvbench.analysis.benchmark_scoring import gsm8k_answer, humaneval_completion, mmlu_answer, same_number
from kvbench.analysis.code_execution import CodeCheck, check_completions
from kvbench.analysis.task_score import score_requests, task_figures
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tokenizer import load_tokenizer

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("output, answer, how", [
    ("6 * 12 = 72, 72 - 50 = 22.\nThe answer is 22.", "22", "marker"),
    ("The answer is: $1,250.00 in all.", "1250.00", "marker"),
    ("The answer is 7. Wait, the answer is 9.", "9", "marker"),  # the last marker counts
    ("So she has 15 apples, then 20 more: 35", "35", "last number"),
    ("no figures at all", None, "none"),
])
def test_gsm8k_reads_the_marker_then_the_last_number(output: str, answer: str | None, how: str) -> None:
    parsed = gsm8k_answer(output)
    assert (parsed.answer, parsed.how) == (answer, how)


def test_gsm8k_answers_compare_as_numbers() -> None:
    assert same_number("1250.00", "1,250") and same_number("-3", "-3.0")
    assert not same_number("125", "1250") and not same_number(None, "3")


@pytest.mark.parametrize("output, letter", [
    ("Mercury is closest to the Sun.\nAnswer: B", "B"),
    ("Reasoning...\n**Answer: (C)**", "C"),
    ("Answer: A.\n", "A"),
    ("Answer: A\nOn second thought:\nAnswer: D", "D"),
    ("The answer is B because Mercury is fast.", None),  # no answer line: never guessed
    ("Answer: B or C", None),
    ("Answer: E", None),
    ("I think A and B are wrong. C might be. Answer follows: D", None),
])
def test_mmlu_takes_only_a_strict_answer_line(output: str, letter: str | None) -> None:
    assert mmlu_answer(output).answer == letter


def test_humaneval_takes_the_last_code_block_and_keeps_a_body_as_a_continuation() -> None:
    whole = "Plan first.\n```python\ndef f(x):\n    return 1\n```\nThen:\n```python\ndef f(x):\n    return x\n```\n"
    assert humaneval_completion(whole, "f").answer == "\ndef f(x):\n    return x\n"
    body = "    return x + 1\n"
    assert humaneval_completion(body, "f").answer == body and humaneval_completion(body, "f").how == "raw"


PROMPT = "def add(a: int, b: int) -> int:\n    \"\"\"Return a + b.\"\"\"\n"
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_humaneval_completions_run_with_their_tests_in_a_guarded_process(tmp_path: Path) -> None:
    outside = Path("/tmp") / f"kvbench-guard-{uuid.uuid4().hex}"
    checks = [
        CodeCheck("passes", PROMPT, "    return a + b\n", TEST, "add"),
        CodeCheck("fails", PROMPT, "    return a * b\n", TEST, "add"),
        CodeCheck("loops", PROMPT, "    while True:\n        pass\n", TEST, "add"),
        CodeCheck("writes", PROMPT, f"    open({str(outside)!r}, 'w').write('x')\n    return a + b\n", TEST, "add"),
        CodeCheck("connects", PROMPT, "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n"
                  "    return a + b\n", TEST, "add"),
    ]
    results = {r.task_id: r for r in check_completions(checks, timeout_s=1.0)}
    assert results["passes"].passed and results["passes"].result == "passed"
    assert not results["fails"].passed and results["fails"].result.startswith("failed")
    assert not results["loops"].passed and results["loops"].result == "timed out"  # killed at its time limit
    assert not results["writes"].passed and "no writing outside" in results["writes"].result
    assert not outside.exists()
    assert not results["connects"].passed and "no network" in results["connects"].result


def _requests(trajectories, texts: list[str], tokenizer) -> pd.DataFrame:
    rows = []
    for trajectory, text in zip(trajectories, texts):
        for turn in trajectory.turns:
            final = turn.turn_id == trajectory.task.final_turn
            rows.append({"trajectory_id": trajectory.trajectory_id, "turn_id": turn.turn_id,
                         "success": final and text is not None,
                         "output_token_ids": tokenizer.encode(text if final and text is not None else "notes")})
    return pd.DataFrame(rows)


def _gsm8k_outputs(golds: list[str]) -> list[str | None]:
    return [f"Left: 72 - 50.\nThe answer is {golds[0]}.", f"The answer is {int(golds[1]) + 1}.",
            f"so {int(golds[2]):,} in all", None]  # right, wrong, right by the last number, failed


def _mmlu_outputs(golds: list[str]) -> list[str | None]:
    other = "A" if golds[1] != "A" else "B"
    return [f"Answer: {golds[0]}", f"Answer: {other}", f"It is {golds[2]}, clearly.", None]


@pytest.mark.parametrize("task, data, outputs, correct, unparseable", [
    ("gsm8k", "gsm8k-sample.jsonl", _gsm8k_outputs, [True, False, True, False], 0),
    ("mmlu", "mmlu-sample.parquet", _mmlu_outputs, [True, False, False, False], 1),  # the third has no answer line
])
def test_a_run_scores_its_final_answers(task: str, data: str, outputs, correct: list[bool], unparseable: int) -> None:
    tokenizer = load_tokenizer(None)
    trajectories = generate_trace(TraceSpec(task=task, data=str(DATA / data), shared_tokens=0, qps=0, limit=4),
                                  tokenizer)[1]
    texts = outputs([t.task.answers[0].answer for t in trajectories])  # type: ignore[union-attr]
    scores = score_requests(_requests(trajectories, texts, tokenizer), trajectories, tokenizer.decode)
    assert scores["correct"].tolist() == correct and scores["final"].all()
    assert scores["item_id"].notna().all()
    figures = task_figures(scores)
    assert figures["task_accuracy"] == sum(correct) / len(correct)
    assert figures["task_unparseable"] == unparseable


def test_humaneval_runs_score_pass_at_1_from_their_outputs() -> None:
    tokenizer = load_tokenizer(None)
    trajectories = generate_trace(TraceSpec(task="humaneval", data=str(DATA / "humaneval-sample.jsonl"),
                                            shared_tokens=0, qps=0), tokenizer)[1]
    passing = ("```python\ndef count_vowels(text: str) -> int:\n"
               "    return sum(1 for c in text.lower() if c in 'aeiou')\n```")
    failing = "```python\ndef running_max(values):\n    return values\n```"
    scores = score_requests(_requests(trajectories, [passing, failing], tokenizer), trajectories, tokenizer.decode)
    assert scores["correct"].tolist() == [True, False]
    assert scores["detail"].iloc[0] == "passed" and scores["detail"].iloc[1].startswith("failed")
    assert task_figures(scores)["task_accuracy"] == 0.5
