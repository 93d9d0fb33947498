"""Built-in tasks, generated deterministically from a seed, each with its verifier."""

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


def make_task(name: str, difficulty: str = "easy") -> Task:
    """A built-in task at a preset difficulty ("easy", "medium", "hard")."""
    if name not in _TASKS:
        raise ValueError(f"task: {name!r} is not one of {sorted(_TASKS)}")
    return _TASKS[name].preset(difficulty)  # type: ignore[attr-defined,no-any-return]
