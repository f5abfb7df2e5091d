"""`gen-trace --task mmlu`: MMLU questions (`cais/mmlu`'s parquet or JSONL export) in the paper's
four-agent workload (kvbench.tracegen.tasks.benchmark).

Data: `question`, `choices` (four strings), `answer` (0-3, or a letter A-D); `subject` when present.
Answer: the letter of the last line of the form "Answer: X" (X one of A-D, optionally in
parentheses or bold, a period after it). Anything else is unparseable, and counted, never
guessed from a letter somewhere in the text.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

from kvbench.tracegen.datasets import DatasetError, TaskItem
from kvbench.tracegen.schema import Trajectory, TurnAnswer
from kvbench.tracegen.tasks.base import Parsed, Score
from kvbench.tracegen.tasks.benchmark import REFLECT, BenchmarkTask, benchmark_role

ANSWER_MARKER = "Answer:"  # what FinalRefer is told to end with
LETTERS = "ABCD"
_ANSWER_LINE = re.compile(r"^\s*\**\s*" + re.escape(ANSWER_MARKER) + r"\s*\**\s*\(?([ABCD])\)?\s*\**\s*\.?\s*\**\s*$")


def mmlu_answer(output: str) -> Parsed:
    """The answer letter (None: unparseable) and how it was read."""
    for line in reversed(output.splitlines()):
        match = _ANSWER_LINE.match(line)
        if match:
            return Parsed(match.group(1), "answer line")
    return Parsed(None, "none")


class MMLU(BenchmarkTask):
    name = "mmlu"
    summary = "MMLU multiple choice (--data: cais/mmlu's parquet or JSONL); the final agent's letter"
    columns = ("question", "choices", "answer")
    agent_roles = (
        benchmark_role("Knowledgeable Expert",
                       "You are the team member who knows the background. Recall the facts, definitions and "
                       "results the question depends on, and say briefly how each one bears on the choices."),
        benchmark_role("Wiki Searcher",
                       "You are the team member who looks things up. Write what a reference work would say about "
                       "the key terms of the question, as short factual notes, and point out which choice they "
                       "support or rule out."),
        benchmark_role("Critic",
                       "You are the team member who checks the others. Go through each choice, say what speaks "
                       "against it, and point out any mistake in your teammates' notes."),
        benchmark_role("FinalRefer",
                       REFLECT + f"End with a line of the form '{ANSWER_MARKER} X', where X is the letter "
                       "(A, B, C or D) of the correct choice, and write nothing after it."),
    )

    def item(self, row: dict[str, Any], index: int, where: str) -> TaskItem:
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

    def score(self, text: str, gold: TurnAnswer, trajectory: Trajectory) -> Score:
        answer, how = mmlu_answer(text)
        return Score(answer=answer, parsed=how, correct=answer == gold.answer)


TASK = MMLU()
