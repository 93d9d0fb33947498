"""Big-number arithmetic where a calculator helps: "4821*397=" -> "1913937".

A 0.1M-parameter character model cannot multiply a 4-digit by a 3-digit number in its
head, but it can write the call `[4821*397]`, read the result `(1913937)` and copy it.
So the reward separates a model that learned to use the tool from one that guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

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

# The "chat" style: a chat model's question and the one-line reply the verifier wants, and
# the worked example shown before the question (`example_messages`).
_QUESTION = "What is {a} {op} {b}?"
_REPLY = "The answer is {value}."
_EXAMPLE = (23, "*", 41)


@dataclass(frozen=True)
class ToolArithmeticTask:
    """Products (or sums) of two integers of exactly `digits_a` and `digits_b` digits,
    posed bare ("4821*397=") and answered with the digits ("1913937").

    environment: the registered environment trajectories run in (`rlax_data.envs`).
    sft_tool_fraction: the share of SFT demonstrations that call the tool; the others
    answer directly. Which records use it is fixed per record id, and raising the fraction
    only adds tool users (a record's draw does not depend on the fraction).

    style: "bare" poses "4821*397=" for a character-level model, answered "1913937" (the
    calculator's result is `(1913937)`); "chat" asks a chat model "What is 4821 * 397?",
    answered "The answer is 1913937." (the exact-match verifier reads the reply's first
    line), after one worked example conversation in the run's tool format
    (`example_messages`): SmolLM2-135M-Instruct called the calculator in 2 of 64 replies
    when told how in words, and in 19 of 64 after the example (docs/benchmarks.md,
    "SmolLM2 learns to use a calculator"). Both styles pose the same numbers for the same
    (config, seed, index).
    """

    digits_a: int = 3
    digits_b: int = 2
    ops: str = "*"
    name: str = "tool_arithmetic"
    environment: str = "calculator"
    sft_tool_fraction: float = 0.5
    style: Literal["bare", "chat"] = "bare"

    def __post_init__(self) -> None:
        for field_name in ("digits_a", "digits_b"):
            value = getattr(self, field_name)
            if not 1 <= value <= 30:
                raise ValueError(f"field `{field_name}`: must be in [1, 30], got {value}")
        if not self.ops or set(self.ops) - set("*+"):
            raise ValueError(f"field `ops`: must be a non-empty subset of '*+', got {self.ops!r}")
        if not 0.0 <= self.sft_tool_fraction <= 1.0:
            raise ValueError(f"field `sft_tool_fraction`: must be in [0, 1], got {self.sft_tool_fraction}")
        if self.style not in ("bare", "chat"):
            raise ValueError(f"field `style`: must be 'bare' or 'chat', got {self.style!r}")

    @classmethod
    def preset(cls, difficulty: str) -> ToolArithmeticTask:
        if difficulty not in _PRESETS:
            raise ValueError(f"difficulty: {difficulty!r} is not one of {sorted(_PRESETS)}")
        return cls(**_PRESETS[difficulty])

    @property
    def format(self) -> TaskFormat:
        # Prompts and answers, plus the bracket calls "[a*b]" and results "(123)" / "(?)".
        signs = "".join(sorted(set(self.ops)))
        if self.style == "chat":  # a chat model's tokenizer: the alphabet is not used
            fixed = _QUESTION.format(a="", op="", b="") + _REPLY.format(value="")
            return TaskFormat(_QUESTION, _REPLY.replace("{value}", "{answer}"), fixed + "0123456789" + signs)
        return TaskFormat("{expression}=", "{answer}", "0123456789" + signs + "=[]()?")

    def _one(self, seed: int, i: int) -> Record:
        # Only the problem's fields key the RNG: the environment or the SFT mix do not
        # change which problems are posed.
        rng = record_rng(self.name, (self.digits_a, self.digits_b, self.ops), seed, i)
        a = rng.randint(10 ** (self.digits_a - 1), 10**self.digits_a - 1)
        b = rng.randint(10 ** (self.digits_b - 1), 10**self.digits_b - 1)
        op = rng.choice(self.ops)
        expression = f"{a}{op}{b}"
        value = str(a * b if op == "*" else a + b)
        metadata: dict[str, Any] = {
            "difficulty": {"digits_a": self.digits_a, "digits_b": self.digits_b, "ops": self.ops},
            "expression": expression,
        }
        if self.style == "chat":
            return Record(
                id=f"{self.name}-chat-{seed}-{i}",
                prompt=_QUESTION.format(a=a, op=op, b=b),
                answer=_REPLY.format(value=value),
                task=self.name,
                metadata={**metadata, "value": value},
            )
        return Record(
            id=f"{self.name}-{seed}-{i}",
            prompt=self.format.prompt_template.format(expression=expression),
            answer=value,
            task=self.name,
            metadata=metadata,
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
        # The calculator's result is the value; the chat style's answer is a sentence around it.
        value = str(record.metadata.get("value", answer))
        return [
            (fmt.render_call(call), True),
            (fmt.render_result(ToolResult(text=value, ok=True)), False),
            (answer, True),
        ]

    def example_messages(self, tool_format: ToolFormat) -> list[dict[str, str]]:
        """The chat style's worked example, as chat messages put before every question: the
        user asks, the assistant calls the calculator in `tool_format`, the tool answers,
        the assistant replies. Empty for the bare style (a model without a chat template)."""
        if self.style != "chat":
            return []
        a, op, b = _EXAMPLE
        value = str(a * b if op == "*" else a + b)
        record = Record(
            id=f"{self.name}-example",
            prompt=_QUESTION.format(a=a, op=op, b=b),
            answer=_REPLY.format(value=value),
            task=self.name,
            metadata={"expression": f"{a}{op}{b}", "value": value},
        )
        roles = {True: "assistant", False: "tool"}
        messages = [{"role": "user", "content": _QUESTION.format(a=a, op=op, b=b)}]
        segments = self.demonstration(record, use_tool=True, tool_format=tool_format)
        return messages + [{"role": roles[is_model], "content": text} for text, is_model in segments]
