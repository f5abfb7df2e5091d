"""What a task module declares: `TaskDefinition`, and the `Score` of one answer."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

from kvbench.tracegen.schema import Trajectory, TurnAnswer

if TYPE_CHECKING:
    from kvbench.tracegen.datasets import TaskItem
    from kvbench.tracegen.roles import Role


class Counter(Protocol):
    """Exact token counts (kvbench.tracegen.generate.TokenCounter)."""

    def count(self, text: str) -> int: ...
    def counts(self, pieces: list[str]) -> list[int]: ...
    def fit(self, pieces: list[str], num_tokens: int, filler: Callable[[], str]) -> str: ...


class Parsed(NamedTuple):
    """An answer as a task's parser read it: the answer (None: unparseable) and how it was read."""

    answer: str | None
    how: str


@dataclass
class Score:
    """One turn's answer as its task read and graded it."""

    answer: str | None  # None: no answer could be read
    correct: bool
    parsed: str | None = None  # how the answer was read (benchmark tasks: "marker", "none", ...)
    detail: str | None = None  # what grading said beyond right or wrong (HumanEval: the harness's result)


@dataclass
class ScoredTurn:
    """A turn's score with what a batch grader (`TaskDefinition.grade`) needs."""

    score: Score
    gold: TurnAnswer
    trajectory: Trajectory


class TaskDefinition:
    """A task. Context tasks (`uses_items` False) put their answers in the shared context of a
    generated workflow (`build`); item tasks make one trajectory per item of a data file (`items`,
    `trajectory`). Every task reads and grades answers (`score`, then `grade` over all of a run's)."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for `kvbench gen-trace --help` and the docs
    roles: ClassVar[str] = "math"  # the role preset unless --roles says otherwise
    model: ClassVar[str | None] = None  # the model its traces name unless --model says otherwise
    uses_items: ClassVar[bool] = False  # one trajectory per item; the item's question is the shared context
    has_default_data: ClassVar[bool] = False  # an item task that runs without --data (its own copy of the items)
    runs_model_code: ClassVar[bool] = False  # grading runs model-written code: consent and a sandbox (tasks/sandbox/)
    # Outputs are read as text without special tokens (an end-of-sequence token is no part of an
    # answer); False: decoded as generated.
    reads_text: ClassVar[bool] = False

    def default_output_len(self, encode: Callable[[str], list[int]]) -> int:
        """`--output-len` when not given."""
        return 128

    def check_roles(self, roles: Sequence[Role]) -> None:
        """Raise ValueError if the task cannot run with these agents' roles."""

    # ---------------------------------------------------------------- context tasks
    def build(self, draft: Trajectory, rng: random.Random, shared_tokens: int, counter: Counter,
              filler: Callable[[], str]) -> Trajectory:
        """`draft` (agents and turns, no shared context yet) with its shared segment `q` of exactly
        `shared_tokens` tokens and its `task` (gold answers)."""
        raise NotImplementedError(f"task {self.name} makes trajectories from items")

    # ---------------------------------------------------------------- item tasks
    def items(self, data: str | None, limit: int | None, seed: int | None) -> list[TaskItem]:
        raise NotImplementedError(f"task {self.name} has no items")

    # ---------------------------------------------------------------- scoring
    def score(self, text: str, gold: TurnAnswer, trajectory: Trajectory) -> Score:
        """One turn's output read and graded against its gold answer."""
        raise NotImplementedError

    def grade(self, scored: list[ScoredTurn]) -> None:
        """Grading that needs every answer of a run at once (HumanEval runs their tests together);
        updates the scores in place. Default: `score` graded each already."""
