"""What every tool-call format provides: the `ToolFormat` protocol and a turn's parsed calls.

A model turn is the model's untrusted text. A format reads every call in it, in order
(`parse`), and a call it cannot read comes back as a `MalformedCall` in its place, so
the well-formed calls around it still run and the model learns which one was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from rlax_data.envs.tools import ToolCall, ToolResult

__all__ = ["MalformedCall", "ParsedCall", "ToolCallError", "ToolFormat", "check_max_calls"]


class ToolCallError(ValueError):
    """A call in a model turn cannot be read; the message says why (the model sees it in
    the error result). Raised inside the formats, and returned as a `MalformedCall`."""


@dataclass(frozen=True)
class MalformedCall:
    """A call that cannot be read, in its place among a turn's calls; `reason` is what the
    model is told."""

    reason: str


ParsedCall: TypeAlias = ToolCall | MalformedCall
"""One call of a model turn as a format read it."""


@runtime_checkable
class ToolFormat(Protocol):
    """How a model writes tool calls and reads their results, as text.

    max_calls: the most calls one model turn may hold; the environment runs that many and
    answers the rest with one refusal. call_stop: a stop string that ends a turn after its
    first call (its tokens stay in the turn); empty when a turn with calls ends with the
    model's end-of-turn token, which is what a format allowing several calls per turn
    needs (a turn stopped after its first call could never hold a second). special_markers:
    special tokens the format reads in a turn (Mistral's `[TOOL_CALLS]`); the codec that
    decodes a turn's tokens keeps them in its text.
    """

    max_calls: int
    call_stop: str
    special_markers: tuple[str, ...]

    def parse(self, turn_text: str) -> list[ParsedCall]:
        """Every call in `turn_text`, in order; empty for a turn without calls (a final
        answer). Never raises for anything in the text."""
        ...

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """The text of a model turn making `calls` (for SFT demonstrations)."""
        ...

    def render_call(self, call: ToolCall) -> str:
        """`render_calls([call])`."""
        ...

    def render_result(self, result: ToolResult) -> str:
        """The text that shows one call's `result` to the model. The chat template's tool
        message wraps it (`rlax_data.agent_turns`); each call's result is a message of its
        own."""
        ...

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """A system message listing `tools` (OpenAI-style function specs) and how to call
        them, for a chat template that does not render `tools=` itself."""
        ...


def check_max_calls(format_name: str, max_calls: int) -> int:
    if type(max_calls) is not int or max_calls < 1:
        raise ValueError(f"{format_name}: max_calls must be an integer >= 1, got {max_calls!r}")
    return max_calls
