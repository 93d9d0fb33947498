"""`data:` the task, how prompts are grouped and sampled, dynamic filtering."""

from __future__ import annotations

from typing import Any

import msgspec

from rlax_core.config.base import Section, check


class DataSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The task, how prompts are grouped and sampled, and dynamic filtering.

    task: a built-in task of `rlax_data` at `difficulty`, its fields overridden by
    `task_args`; `num_train` training records are generated from `seed`. `dataset`: a
    JSONL/Parquet file of records instead of a built-in task."""

    task: str = "arithmetic"
    difficulty: str = "easy"
    task_args: dict[str, Any] = msgspec.field(default_factory=dict)
    dataset: str = ""
    num_train: int = 10000
    seed: int = 0
    group_size: int = 8
    prompts_per_step: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    dynamic_filter: bool = False
    max_filter_draws: int = 64

    def __post_init__(self) -> None:
        check(bool(self.task) or bool(self.dataset), "task", self.task, "a task or a dataset is required")
        check(self.num_train >= 1, "num_train", self.num_train, "must be >= 1")
        check(self.group_size >= 1, "group_size", self.group_size, "must be >= 1")
        check(self.prompts_per_step >= 1, "prompts_per_step", self.prompts_per_step, "must be >= 1")
        check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0")
        check(self.max_filter_draws >= 1, "max_filter_draws", self.max_filter_draws, "must be >= 1")
