"""The task registry: `--task NAME` -> its `TaskDefinition`. Every module of this package holding
a `TASK` is a task (found without a list to keep: a new task is its module)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from pathlib import Path

from kvbench.tracegen.tasks.base import TaskDefinition

TASKS_PACKAGE = "kvbench.tracegen.tasks"
NO_TASK = "none"  # a workload without known answers (the default)
_MACHINERY = {"base", "benchmark", "registry"}  # what tasks share; sandbox/ is a package
_TASKS: dict[str, TaskDefinition] = {}


def task_modules() -> list[str]:
    """The task modules, found without importing them."""
    folder = Path(__file__).parent
    return sorted(f"{TASKS_PACKAGE}.{m.name}" for m in pkgutil.iter_modules([str(folder)])
                  if not m.ispkg and m.name not in _MACHINERY)


def all_tasks() -> dict[str, TaskDefinition]:
    """Every task by name, sorted."""
    if not _TASKS:
        for module in task_modules():
            task = getattr(importlib.import_module(module), "TASK", None)
            if not isinstance(task, TaskDefinition):
                raise TypeError(f"{module} holds no TASK (a TaskDefinition): every module of {TASKS_PACKAGE} but "
                                f"{', '.join(sorted(_MACHINERY))} is a task")
            _TASKS[task.name] = task
    return dict(sorted(_TASKS.items()))


def register(task: TaskDefinition) -> TaskDefinition:
    """Make `task` available as `--task task.name` (for a task outside this package; a name is
    taken once)."""
    if not isinstance(task, TaskDefinition):
        raise TypeError(f"register needs a TaskDefinition, got {task!r}")
    known = all_tasks().get(task.name)
    if known is not None and known is not task:
        raise ValueError(f"task name {task.name!r} is taken by {type(known).__module__}")
    _TASKS[task.name] = task
    return task


def task_names() -> tuple[str, ...]:
    """What --task takes: "none" and every task."""
    return (NO_TASK, *all_tasks())


def benchmark_names() -> tuple[str, ...]:
    """The tasks that read items from a data file (--data TASK=PATH)."""
    return tuple(name for name, task in all_tasks().items() if task.uses_items)


def runs_model_code(task_names: Iterable[str]) -> bool:
    """Whether scoring any of these tasks runs model-written code (consent and a sandbox)."""
    return any(get_task(name).runs_model_code for name in task_names if name != NO_TASK)


def get_task(name: str) -> TaskDefinition:
    tasks = all_tasks()
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(task_names())}")
    return tasks[name]


def default_output_len(task: str, encode: Callable[[str], list[int]]) -> int:
    """`--output-len` when not given: the task's (128 tokens of free text without one)."""
    return 128 if task == NO_TASK else get_task(task).default_output_len(encode)
