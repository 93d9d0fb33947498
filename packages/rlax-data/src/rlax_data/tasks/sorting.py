"""Digit sorting: "s:3142=" -> "1234"."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlax_data.datasets import Record
from rlax_data.tasks.base import TaskFormat, check_count, record_rng
from rlax_data.verify.answers import ExactMatchConfig, ExactMatchVerifier

__all__ = ["SortingTask"]

_PRESETS = {"easy": dict(length=4), "medium": dict(length=7), "hard": dict(length=12, descending=True)}


@dataclass(frozen=True)
class SortingTask:
    """Sort a string of `length` random digits (ascending, or descending if asked).

    `max_length` > `length` makes the lengths long-tailed, as reasoning traces' are: record
    i has min(max_length, floor(length * X)) digits, X Pareto-distributed with shape `tail`
    (at length 2, max_length 24, tail 1.2: a median of 3 digits, a tenth 11 or more, 1% 24).
    The answer is as long as the prompt's digits, so the generated lengths follow."""

    length: int = 4
    descending: bool = False
    name: str = "sorting"
    max_length: int = 0
    tail: float = 1.2

    def __post_init__(self) -> None:
        if not 1 <= self.length <= 64:
            raise ValueError(f"field `length`: must be in [1, 64], got {self.length}")
        if self.max_length and not self.length < self.max_length <= 64:
            raise ValueError(
                f"field `max_length`: must be 0 or in ({self.length}, 64], got {self.max_length}"
            )
        if not self.tail > 0:
            raise ValueError(f"field `tail`: must be > 0, got {self.tail}")

    @classmethod
    def preset(cls, difficulty: str) -> SortingTask:
        if difficulty not in _PRESETS:
            raise ValueError(f"difficulty: {difficulty!r} is not one of {sorted(_PRESETS)}")
        return cls(**_PRESETS[difficulty])  # type: ignore[arg-type]

    @property
    def format(self) -> TaskFormat:
        return TaskFormat(("r" if self.descending else "s") + ":{digits}=", "{answer}", "0123456789:=" + "rs")

    def _one(self, seed: int, i: int) -> Record:
        fields = dataclasses.astuple(self)
        # Records of fixed-length settings are seeded as before the long tail existed.
        rng = record_rng(self.name, fields if self.max_length else fields[:3], seed, i)
        length = self.length
        if self.max_length:
            length = min(self.max_length, int(self.length * rng.paretovariate(self.tail)))
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        answer = "".join(sorted(digits, reverse=self.descending))
        return Record(
            id=f"{self.name}-{seed}-{i}",
            prompt=self.format.prompt_template.format(digits=digits),
            answer=answer,
            task=self.name,
            metadata={"difficulty": {"length": length, "descending": self.descending}},
        )

    def generate(self, n: int, *, seed: int) -> list[Record]:
        check_count(n)
        return [self._one(seed, i) for i in range(n)]

    def verifier(self) -> ExactMatchVerifier:
        return ExactMatchVerifier(ExactMatchConfig(extract="first_line", case_sensitive=True))
