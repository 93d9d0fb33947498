"""Multi-digit arithmetic: "12+7=" -> "19", or as a question answered in one sentence."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rlax_data.datasets import Record
from rlax_data.tasks.base import TaskFormat, check_count, record_rng
from rlax_data.verify.answers import ExactMatchConfig, ExactMatchVerifier

__all__ = ["ArithmeticTask"]

_PRESETS = {
    "easy": dict(digits=2, operands=2, ops="+"),
    "medium": dict(digits=3, operands=2, ops="+-"),
    "hard": dict(digits=4, operands=3, ops="+-*"),
}

# The "sentence" style: a chat model's question, and the one-line reply the verifier wants.
_QUESTION = 'What is {expression}? Start your reply with "The answer is".'
_REPLY = "The answer is {value}."


@dataclass(frozen=True)
class ArithmeticTask:
    """Sums, differences and products of random integers with up to `digits` digits.

    Results are never negative (`allow_negative=False` reorders operands of a
    subtraction), so answers are plain digit strings. Evaluation is left to right with
    the usual precedence of * over + and -.

    style: "bare" writes "12+7=" -> "19" (for a character-level model); "sentence" asks a
    chat model 'What is 12 + 7? Start your reply with "The answer is".' and the answer is
    "The answer is 19." — the exact-match verifier checks the first line of the reply, so
    the reward needs both the format and the value (the value is in `metadata`). Both
    styles draw the same numbers for the same (config, seed, index).
    """

    digits: int = 2
    operands: int = 2
    ops: str = "+"
    allow_negative: bool = False
    name: str = "arithmetic"
    style: Literal["bare", "sentence"] = "bare"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 18:
            raise ValueError(f"field `digits`: must be in [1, 18], got {self.digits}")
        if not 2 <= self.operands <= 8:
            raise ValueError(f"field `operands`: must be in [2, 8], got {self.operands}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"field `ops`: must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.style not in ("bare", "sentence"):
            raise ValueError(f"field `style`: must be 'bare' or 'sentence', got {self.style!r}")

    @classmethod
    def preset(cls, difficulty: str) -> ArithmeticTask:
        if difficulty not in _PRESETS:
            raise ValueError(f"difficulty: {difficulty!r} is not one of {sorted(_PRESETS)}")
        return cls(**_PRESETS[difficulty])  # type: ignore[arg-type]

    @property
    def format(self) -> TaskFormat:
        signs = self.ops + ("-" if self.allow_negative else "")
        if self.style == "sentence":
            fixed = _QUESTION.replace("{expression}", "") + _REPLY.replace("{value}", "")
            return TaskFormat(_QUESTION, "{answer}", "".join(sorted(set(fixed + "0123456789 " + signs))))
        return TaskFormat("{expression}=", "{answer}", "0123456789" + signs + "=")

    def _one(self, seed: int, i: int) -> Record:
        # The style is left out of the RNG's key, so both styles pose the same problems.
        cfg = dataclasses.astuple(self)[:-1]
        rng = record_rng(self.name, cfg, seed, i)
        for _ in range(1000):
            nums = [rng.randint(0, 10**self.digits - 1) for _ in range(self.operands)]
            ops = [rng.choice(self.ops) for _ in range(self.operands - 1)]
            expr = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:]))
            value = _evaluate(nums, ops)
            if value >= 0 or self.allow_negative:
                break
            if self.operands == 2:
                nums.reverse()
                expr = f"{nums[0]}{ops[0]}{nums[1]}"
                value = _evaluate(nums, ops)
                break
        else:  # pragma: no cover - needs 1000 negative draws in a row
            raise RuntimeError(f"arithmetic: no non-negative expression for seed {seed}, index {i}")
        difficulty = {"digits": self.digits, "operands": self.operands, "ops": self.ops}
        if self.style == "sentence":
            # Spaced operators: SmolLM2-135M-Instruct answered "6 + 9" right twice as often
            # as "6+9" (12 vs 6 of 64 replies at temperature 0.7).
            spaced = "".join(f" {c} " if c in "+-*" else c for c in expr)
            return Record(
                id=f"{self.name}-{self.style}-{seed}-{i}",
                prompt=_QUESTION.format(expression=spaced),
                answer=_REPLY.format(value=value),
                task=self.name,
                metadata={"difficulty": difficulty, "value": value, "style": self.style},
            )
        return Record(
            id=f"{self.name}-{seed}-{i}",
            prompt=self.format.prompt_template.format(expression=expr),
            answer=str(value),
            task=self.name,
            metadata={"difficulty": difficulty},
        )

    def generate(self, n: int, *, seed: int) -> list[Record]:
        check_count(n)
        return [self._one(seed, i) for i in range(n)]

    def verifier(self) -> ExactMatchVerifier:
        return ExactMatchVerifier(ExactMatchConfig(extract="first_line"))


def _evaluate(nums: list[int], ops: list[str]) -> int:
    # Precedence without eval: fold products first, then the sums/differences.
    terms = [nums[0]]
    signs = [1]
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))
