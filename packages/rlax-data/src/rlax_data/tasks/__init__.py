"""Built-in tasks, generated deterministically from a seed, each with its verifier."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlax_data.tasks.arithmetic import ArithmeticTask
from rlax_data.tasks.base import Task, TaskFormat, record_rng
from rlax_data.tasks.countdown import CountdownTask
from rlax_data.tasks.sorting import SortingTask
from rlax_data.tasks.tool_arithmetic import ToolArithmeticTask

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "SortingTask",
    "TASK_NAMES",
    "Task",
    "TaskFormat",
    "ToolArithmeticTask",
    "make_task",
    "record_rng",
]

_TASKS = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "sorting": SortingTask,
    "tool_arithmetic": ToolArithmeticTask,
}
TASK_NAMES: tuple[str, ...] = tuple(sorted(_TASKS))
"""The built-in tasks' names (`make_task`, `data.task`)."""


def make_task(
    name: str,
    difficulty: str = "easy",
    overrides: Mapping[str, Any] | None = None,
    *,
    source: str = "task_args",
) -> Task:
    """A built-in task at a preset difficulty ("easy", "medium", "hard").

    overrides: fields of the task's dataclass to set after the preset (`data.task_args` in a
    run config, `--task-arg` of `rlax curate generate`); an unknown field is a ValueError
    naming `source`.
    """
    if name not in _TASKS:
        raise ValueError(f"task: {name!r} is not one of {sorted(_TASKS)}")
    task = _TASKS[name].preset(difficulty)  # type: ignore[attr-defined]
    if overrides:
        try:
            task = dataclasses.replace(task, **overrides)
        except TypeError as error:
            raise ValueError(f"{source} = {dict(overrides)!r}: {error}") from None
    return task  # type: ignore[no-any-return]
