"""`gen-trace --task gsm8k`: GSM8K problems (`openai/gsm8k`, config `main`, parquet or JSONL) in
the paper's four-agent workload (kvbench.tracegen.tasks.benchmark).

Data: `question`, `answer` (the worked solution ending with `#### <number>`: the gold answer).
Answer: the number after the last "The answer is" (the format FinalRefer is asked for); where
there is none, the last number of the output (the usual fallback of GSM8K harnesses). Compared
as numbers: "1,250", "1250.0" and "$1250" are the same answer.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvbench.tracegen.datasets import DatasetError, TaskItem
from kvbench.tracegen.schema import Trajectory, TurnAnswer
from kvbench.tracegen.tasks.base import Parsed, Score
from kvbench.tracegen.tasks.benchmark import REFLECT, BenchmarkTask, benchmark_role

ANSWER_MARKER = "The answer is"  # what FinalRefer is told to end with
SOLUTION_MARKER = re.compile(r"####\s*(.+?)\s*$", re.S)
_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+"
_MARKED = re.compile(re.escape(ANSWER_MARKER) + r"[:\s]*\**\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def _number(text: str) -> str:
    return text.replace("$", "").replace(",", "").rstrip(".")


def gsm8k_answer(output: str) -> Parsed:
    """The answer (None: unparseable) and how it was read."""
    marked = _MARKED.findall(output)
    if marked:
        return Parsed(_number(marked[-1]), "marker")
    numbers = _ANY_NUMBER.findall(output)
    return Parsed(_number(numbers[-1]), "last number") if numbers else Parsed(None, "none")


def same_number(answer: str | None, gold: str) -> bool:
    if answer is None:
        return False
    try:
        return math.isclose(float(answer), float(_number(gold)), rel_tol=0, abs_tol=1e-6)
    except ValueError:
        return False


class GSM8K(BenchmarkTask):
    name = "gsm8k"
    summary = "GSM8K word problems (--data: openai/gsm8k's parquet or JSONL); the final agent's number"
    columns = ("question", "answer")
    agent_roles = (
        benchmark_role("Math Solver",
                       "You are the team member who solves the problem. Work through it step by step, writing "
                       "each calculation out, and state the number you arrive at."),
        benchmark_role("Mathematical Analyst",
                       "You are the team member who analyses the problem. Name the quantities it gives and the "
                       "one it asks for, write down how they relate, then compute, checking each value against "
                       "your teammates' work."),
        benchmark_role("Programming Expert",
                       "You are the team member who programs. Write a short Python function without parameters "
                       "that computes the answer to the problem, with a clear name for every quantity, and say "
                       "what it returns."),
        benchmark_role("FinalRefer",
                       REFLECT + f"End with a line of the form '{ANSWER_MARKER} N.', where N is the final "
                       "number alone, without units."),
    )

    def item(self, row: dict[str, Any], index: int, where: str) -> TaskItem:
        match = SOLUTION_MARKER.search(str(row["answer"]))
        if match is None:
            raise DatasetError(f"{where}: answer: no '#### <number>' marker ending the solution")
        gold = match.group(1).replace(",", "")
        return TaskItem(str(row.get("id", f"gsm8k-{index}")), str(row["question"]).strip(), gold)

    def score(self, text: str, gold: TurnAnswer, trajectory: Trajectory) -> Score:
        answer, how = gsm8k_answer(text)
        return Score(answer=answer, parsed=how, correct=same_number(answer, gold.answer))


TASK = GSM8K()
