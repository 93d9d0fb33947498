"""Big-number arithmetic where a calculator helps: "4821*397=" -> "1913937".

A 0.1M-parameter character model cannot multiply a 4-digit by a 3-digit number in its
head, but it can write the call `[4821*397]`, read the result `(1913937)` and copy it.
So the reward separates a model that learned to use the tool from one that guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlax_data.datasets import Record
from rlax_data.envs.formats import BracketToolFormat, ToolFormat
from rlax_data.envs.tools import CalculatorTool, ToolCall, ToolResult
from rlax_data.tasks.base import TaskFormat, check_count, record_rng
from rlax_data.verify.answers import ExactMatchConfig, ExactMatchVerifier

__all__ = ["ToolArithmeticTask"]

_PRESETS: dict[str, dict[str, Any]] = {
    "easy": dict(digits_a=3, digits_b=2),
    "medium": dict(digits_a=4, digits_b=3),
    "hard": dict(digits_a=5, digits_b=4),
}


@dataclass(frozen=True)
class ToolArithmeticTask:
    """Products (or sums) of two integers of exactly `digits_a` and `digits_b` digits,
    posed bare ("4821*397=") and answered with the digits ("1913937").

    environment: the registered environment trajectories run in (`rlax_data.envs`).
    sft_tool_fraction: the share of SFT demonstrations that call the tool; the others
    answer directly. Which records use it is fixed per record id, and raising the fraction
    only adds tool users (a record's draw does not depend on the fraction).
    """

    digits_a: int = 3
    digits_b: int = 2
    ops: str = "*"
    name: str = "tool_arithmetic"
    environment: str = "calculator"
    sft_tool_fraction: float = 0.5

    def __post_init__(self) -> None:
        for field_name in ("digits_a", "digits_b"):
            value = getattr(self, field_name)
            if not 1 <= value <= 30:
                raise ValueError(f"field `{field_name}`: must be in [1, 30], got {value}")
        if not self.ops or set(self.ops) - set("*+"):
            raise ValueError(f"field `ops`: must be a non-empty subset of '*+', got {self.ops!r}")
        if not 0.0 <= self.sft_tool_fraction <= 1.0:
            raise ValueError(f"field `sft_tool_fraction`: must be in [0, 1], got {self.sft_tool_fraction}")

    @classmethod
    def preset(cls, difficulty: str) -> ToolArithmeticTask:
        if difficulty not in _PRESETS:
            raise ValueError(f"difficulty: {difficulty!r} is not one of {sorted(_PRESETS)}")
        return cls(**_PRESETS[difficulty])

    @property
    def format(self) -> TaskFormat:
        # Prompts and answers, plus the bracket calls "[a*b]" and results "(123)" / "(?)".
        signs = "".join(sorted(set(self.ops)))
        return TaskFormat("{expression}=", "{answer}", "0123456789" + signs + "=[]()?")

    def _one(self, seed: int, i: int) -> Record:
        # Only the problem's fields key the RNG: the environment or the SFT mix do not
        # change which problems are posed.
        rng = record_rng(self.name, (self.digits_a, self.digits_b, self.ops), seed, i)
        a = rng.randint(10 ** (self.digits_a - 1), 10**self.digits_a - 1)
        b = rng.randint(10 ** (self.digits_b - 1), 10**self.digits_b - 1)
        op = rng.choice(self.ops)
        expression = f"{a}{op}{b}"
        return Record(
            id=f"{self.name}-{seed}-{i}",
            prompt=self.format.prompt_template.format(expression=expression),
            answer=str(a * b if op == "*" else a + b),
            task=self.name,
            metadata={
                "difficulty": {"digits_a": self.digits_a, "digits_b": self.digits_b, "ops": self.ops},
                "expression": expression,
            },
        )

    def generate(self, n: int, *, seed: int) -> list[Record]:
        check_count(n)
        return [self._one(seed, i) for i in range(n)]

    def verifier(self) -> ExactMatchVerifier:
        return ExactMatchVerifier(ExactMatchConfig(extract="first_line"))

    def uses_tool_in_demonstration(self, record: Record) -> bool:
        """Whether `record`'s SFT demonstration calls the tool (fixed per record id)."""
        draw = record_rng(f"{self.name}/demonstration", record.id, 0, 0).random()
        return draw < self.sft_tool_fraction

    def demonstration(
        self, record: Record, *, use_tool: bool, tool_format: ToolFormat | None = None
    ) -> list[tuple[str, bool]]:
        """The SFT trajectory as (text, is_model_turn) segments, without the final EOS.

        With the tool, in the bracket format: [("[4821*397]", True), ("(1913937)", False),
        ("1913937", True)]; without: [("1913937", True)]. `tool_format` defaults to
        `BracketToolFormat()`.
        """
        answer = record.answer
        if answer is None:
            raise ValueError(f"record {record.id!r}: field `answer` is required for a demonstration")
        if not use_tool:
            return [(answer, True)]
        expression = record.metadata.get("expression")
        if not isinstance(expression, str) or not expression:
            raise ValueError(
                f"record {record.id!r}: metadata field `expression` is required for a tool demonstration"
            )
        fmt = tool_format if tool_format is not None else BracketToolFormat()
        call = ToolCall(name=CalculatorTool.name, arguments={"expression": expression})
        return [
            (fmt.render_call(call), True),
            (fmt.render_result(ToolResult(text=answer, ok=True)), False),
            (answer, True),
        ]
