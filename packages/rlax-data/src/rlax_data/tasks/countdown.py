"""Countdown: reach a target from given numbers with + - * /. "3,5,2>13:" -> "3*5-2"."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from fractions import Fraction

from rlax_data.datasets import Record
from rlax_data.tasks.base import TaskFormat, check_count, record_rng
from rlax_data.verify.countdown import CountdownConfig, CountdownVerifier

__all__ = ["CountdownTask"]

_PRESETS = {
    "easy": dict(count=3, max_number=9, ops="+-"),
    "medium": dict(count=3, max_number=20, ops="+-*/"),
    "hard": dict(count=4, max_number=50, ops="+-*/", max_target=500),
}


@dataclass(frozen=True)
class CountdownTask:
    """`count` numbers in [1, max_number] and a target in [0, max_target] reachable by
    combining all of them (a random expression tree; every intermediate value is a
    non-negative integer). `rule`: use each number "exactly" once, or "at_most" once.
    The reference expression is kept in `answer`; the verifier recomputes, so any
    valid expression scores."""

    count: int = 3
    max_number: int = 9
    ops: str = "+-"
    max_target: int = 100
    rule: str = "exactly"
    name: str = "countdown"

    def __post_init__(self) -> None:
        if not 2 <= self.count <= 6:
            raise ValueError(f"field `count`: must be in [2, 6], got {self.count}")
        if self.max_number < 1:
            raise ValueError(f"field `max_number`: must be >= 1, got {self.max_number}")
        if not self.ops or set(self.ops) - set("+-*/"):
            raise ValueError(f"field `ops`: must be a non-empty subset of '+-*/', got {self.ops!r}")
        if self.rule not in ("exactly", "at_most"):
            raise ValueError(f"field `rule`: must be 'exactly' or 'at_most', got {self.rule!r}")

    @classmethod
    def preset(cls, difficulty: str) -> CountdownTask:
        if difficulty not in _PRESETS:
            raise ValueError(f"difficulty: {difficulty!r} is not one of {sorted(_PRESETS)}")
        return cls(**_PRESETS[difficulty])  # type: ignore[arg-type]

    @property
    def format(self) -> TaskFormat:
        return TaskFormat("{numbers}>{target}:", "{answer}", "0123456789,>:()" + self.ops)

    def _build(self, rng: random.Random, nums: list[int]) -> tuple[str, Fraction] | None:
        # Combine two random sub-expressions until one is left; `None` if an op is invalid.
        items: list[tuple[str, Fraction, bool]] = [(str(n), Fraction(n), True) for n in nums]
        while len(items) > 1:
            a = items.pop(rng.randrange(len(items)))
            b = items.pop(rng.randrange(len(items)))
            op = rng.choice(self.ops)
            if op == "+":
                val = a[1] + b[1]
            elif op == "-":
                if a[1] < b[1]:
                    a, b = b, a
                val = a[1] - b[1]
            elif op == "*":
                val = a[1] * b[1]
            else:
                if b[1] == 0 or (a[1] / b[1]).denominator != 1:
                    return None
                val = a[1] / b[1]
            left = _wrap(a, op, is_right=False)
            right = _wrap(b, op, is_right=True)
            items.append((f"{left}{op}{right}", val, False))
        return items[0][0], items[0][1]

    def _one(self, seed: int, i: int) -> Record:
        rng = record_rng(self.name, dataclasses.astuple(self), seed, i)
        for _ in range(10_000):
            nums = [rng.randint(1, self.max_number) for _ in range(self.count)]
            built = self._build(rng, nums)
            if built is None:
                continue
            expr, value = built
            if value.denominator == 1 and 0 <= value <= self.max_target:
                break
        else:  # pragma: no cover
            raise RuntimeError(f"countdown: no valid puzzle for seed {seed}, index {i}")
        target = int(value)
        numbers = ",".join(map(str, nums))
        return Record(
            id=f"{self.name}-{seed}-{i}",
            prompt=self.format.prompt_template.format(numbers=numbers, target=target),
            answer=expr,
            task=self.name,
            metadata={"numbers": nums, "target": target, "rule": self.rule},
        )

    def generate(self, n: int, *, seed: int) -> list[Record]:
        check_count(n)
        return [self._one(seed, i) for i in range(n)]

    def verifier(self) -> CountdownVerifier:
        return CountdownVerifier(CountdownConfig(extract="first_line"))


def _wrap(item: tuple[str, Fraction, bool], op: str, *, is_right: bool) -> str:
    """Parenthesise an operand only where precedence or associativity would change its value."""
    text, _, atomic = item
    if atomic or op == "+":
        return text
    if op == "-":
        return text if not is_right or _is_product(text) else f"({text})"
    if op == "*":
        return text if _is_product(text) else f"({text})"
    return text if not is_right and _is_product(text) else f"({text})"


def _is_product(expr: str) -> bool:
    """True when `expr` has no top-level + or - (so it needs no parentheses under * or /)."""
    depth = 0
    for ch in expr:
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and ch in "+-":
            return False
    return True
