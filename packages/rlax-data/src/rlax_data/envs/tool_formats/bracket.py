"""The character model's calls: `[ARG]`, answered by `(TEXT)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlax_data.envs.tool_formats.base import MalformedCall, ParsedCall
from rlax_data.envs.tools import ToolCall, ToolResult

__all__ = ["BracketToolFormat"]


class BracketToolFormat:
    """For a character-level model over a small alphabet: `[ARG]` calls `default_tool`
    with `{argument: ARG}`, and the result reads `(TEXT)`, or `(?)` for a failed call (such
    a model cannot spell error messages; the error kind still reaches the metrics).

    A turn without brackets is a final answer. Text before `[` is allowed and ignored;
    `[` without `]`, a `]` with no `[` before it, nested `[`, an empty `[]`, text after
    `]` or an argument over `max_arg_chars` make the call malformed. One call per turn: a
    turn stops at `]` (`max_calls` must be 1).
    """

    call_stop = "]"
    special_markers: tuple[str, ...] = ()

    def __init__(
        self,
        default_tool: str = "calculator",
        argument: str = "expression",
        *,
        max_calls: int = 1,
        max_arg_chars: int = 256,
    ) -> None:
        if max_calls != 1:
            raise ValueError(
                f"BracketToolFormat: a turn holds one call (it stops at ']'), so max_calls must be 1, got {max_calls!r}"
            )
        self.max_calls = 1
        self.default_tool = default_tool
        self.argument = argument
        self.max_arg_chars = max_arg_chars

    def parse(self, turn_text: str) -> list[ParsedCall]:
        start = turn_text.find("[")
        close = turn_text.find("]")
        if start < 0:
            return [MalformedCall("']' without '['")] if close >= 0 else []
        if 0 <= close < start:
            return [MalformedCall("']' before '['")]
        if close < 0:
            return [MalformedCall("'[' is not closed by ']'")]
        arg = turn_text[start + 1 : close]
        if "[" in arg:
            return [MalformedCall("nested '['")]
        if turn_text[close + 1 :]:
            return [MalformedCall("text after ']'")]
        if not arg:
            return [MalformedCall("empty call '[]'")]
        if len(arg) > self.max_arg_chars:
            return [MalformedCall(f"the call is longer than {self.max_arg_chars} characters")]
        return [ToolCall(name=self.default_tool, arguments={self.argument: arg})]

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        if len(calls) != 1:
            raise ValueError(f"BracketToolFormat: a turn holds one call, got {len(calls)}")
        return self.render_call(calls[0])

    def render_call(self, call: ToolCall) -> str:
        if call.name != self.default_tool or set(call.arguments) != {self.argument}:
            raise ValueError(
                f"BracketToolFormat: can only write calls of {self.default_tool!r} with the single "
                f"argument {self.argument!r}, got {call.name!r} with {sorted(call.arguments)}"
            )
        arg = call.arguments[self.argument]
        if type(arg) is not str or not arg or "[" in arg or "]" in arg:
            raise ValueError(
                f"BracketToolFormat: the argument must be a non-empty string without brackets, got {arg!r}"
            )
        return f"[{arg}]"

    def render_result(self, result: ToolResult) -> str:
        return f"({result.text})" if result.ok else "(?)"

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return (
            f"Write [{self.argument}] to call the {self.default_tool} with it; "
            "its result comes back in parentheses, (?) when the call failed."
        )
