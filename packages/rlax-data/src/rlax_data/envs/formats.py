"""How a model writes a tool call and reads its result, as text.

A format parses a model turn into a `ToolCall` (None for a final answer; `ToolCallError`
for a call it cannot read) and renders calls (for SFT demonstrations) and results (the
next environment turn). The inference engine stops a turn on `call_stop`, so a turn
holding a call ends with it.

Parsing is the model's untrusted text: sizes are checked before any JSON is decoded, and
decoded structures are checked for depth, so a hostile turn costs linear time at most.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, runtime_checkable

from rlax_data.envs.tools import ToolCall, ToolResult

__all__ = [
    "BracketToolFormat",
    "HermesToolFormat",
    "ToolCallError",
    "ToolFormat",
    "make_tool_format",
    "tool_format_names",
]


class ToolCallError(ValueError):
    """A model turn holds a call that cannot be read; the message says why (the model sees
    it in the error result)."""


@runtime_checkable
class ToolFormat(Protocol):
    """call_stop: the stop string that ends a model turn holding a call; its tokens stay
    in the turn."""

    call_stop: str

    def parse(self, turn_text: str) -> ToolCall | None:
        """The call in `turn_text`, or None when it holds none (a final answer); raises
        `ToolCallError` for a malformed call."""
        ...

    def render_call(self, call: ToolCall) -> str:
        """The text a model writes for `call` (ending with `call_stop`)."""
        ...

    def render_result(self, result: ToolResult) -> str:
        """The text of the environment turn that shows `result`."""
        ...


class HermesToolFormat:
    """Hermes / Qwen style: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    Text before `<tool_call>` (the model's reasoning) is allowed; only whitespace may
    follow `</tool_call>`: one call per turn. The result is shown as
    `<tool_response>\\n{text}\\n</tool_response>`; wrapping it in the chat template's tool
    role is the worker's job.

    max_call_chars: longest JSON payload decoded; max_depth: deepest nesting of objects
    and arrays allowed in it.
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, *, max_call_chars: int = 65536, max_depth: int = 32) -> None:
        self.call_stop = self.CLOSE
        self.max_call_chars = max_call_chars
        self.max_depth = max_depth

    def parse(self, turn_text: str) -> ToolCall | None:
        start = turn_text.find(self.OPEN)
        if start < 0:
            if self.CLOSE in turn_text:
                raise ToolCallError(f"{self.CLOSE} without {self.OPEN}")
            return None
        if self.CLOSE in turn_text[:start]:
            raise ToolCallError(f"{self.CLOSE} before {self.OPEN}")
        body_start = start + len(self.OPEN)
        end = turn_text.find(self.CLOSE, body_start)
        if end < 0:
            raise ToolCallError(f"{self.OPEN} is not closed by {self.CLOSE}")
        if turn_text[end + len(self.CLOSE) :].strip():
            raise ToolCallError(f"text after {self.CLOSE}: write one call per turn and wait for its result")
        payload = turn_text[body_start:end].strip()
        if self.OPEN in payload:
            raise ToolCallError(f"{self.OPEN} inside a call")
        if len(payload) > self.max_call_chars:
            raise ToolCallError(f"the call is longer than {self.max_call_chars} characters")
        too_deep = f"the call's JSON is nested deeper than {self.max_depth} levels"
        # Checked before decoding: the decoder recurses once per level.
        if _nesting(payload, self.max_depth) > self.max_depth:
            raise ToolCallError(too_deep)
        try:
            data = json.loads(payload, parse_constant=_reject_constant)
        except RecursionError:  # pragma: no cover - the nesting check comes first
            raise ToolCallError(too_deep) from None
        except ValueError as e:  # JSONDecodeError, NaN, ints beyond Python's digit limit
            raise ToolCallError(f"the call is not valid JSON ({e})") from None
        if type(data) is not dict:
            raise ToolCallError(
                f'the call must be a JSON object {{"name": ..., "arguments": {{...}}}}, not {_kind(data)}'
            )
        extra = sorted(set(data) - {"name", "arguments"})
        if extra:
            raise ToolCallError(f"the call has unexpected keys {extra[:5]}; it takes only name and arguments")
        name, arguments = data.get("name"), data.get("arguments")
        if type(name) is not str or not name:
            raise ToolCallError(f"the call's name must be a non-empty string, got {_kind(name)}")
        if type(arguments) is not dict:
            raise ToolCallError(f"the call's arguments must be a JSON object, got {_kind(arguments)}")
        return ToolCall(name=name, arguments=arguments)

    def render_call(self, call: ToolCall) -> str:
        payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{self.OPEN}\n{payload}\n{self.CLOSE}"

    def render_result(self, result: ToolResult) -> str:
        return f"<tool_response>\n{result.text}\n</tool_response>"


class BracketToolFormat:
    """For a character-level model over a small alphabet: `[ARG]` calls `default_tool`
    with `{argument: ARG}`, and the result reads `(TEXT)`, or `(?)` for a failed call (such
    a model cannot spell error messages; the error kind still reaches the metrics).

    A turn without brackets is a final answer. Text before `[` is allowed and ignored;
    `[` without `]`, a `]` with no `[` before it, nested `[`, an empty `[]`, text after
    `]` or an argument over `max_arg_chars` make the call malformed.
    """

    def __init__(
        self, default_tool: str = "calculator", argument: str = "expression", *, max_arg_chars: int = 256
    ) -> None:
        self.call_stop = "]"
        self.default_tool = default_tool
        self.argument = argument
        self.max_arg_chars = max_arg_chars

    def parse(self, turn_text: str) -> ToolCall | None:
        start = turn_text.find("[")
        close = turn_text.find("]")
        if start < 0:
            if close >= 0:
                raise ToolCallError("']' without '['")
            return None
        if 0 <= close < start:
            raise ToolCallError("']' before '['")
        if close < 0:
            raise ToolCallError("'[' is not closed by ']'")
        arg = turn_text[start + 1 : close]
        if "[" in arg:
            raise ToolCallError("nested '['")
        if turn_text[close + 1 :]:
            raise ToolCallError("text after ']'")
        if not arg:
            raise ToolCallError("empty call '[]'")
        if len(arg) > self.max_arg_chars:
            raise ToolCallError(f"the call is longer than {self.max_arg_chars} characters")
        return ToolCall(name=self.default_tool, arguments={self.argument: arg})

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


_FORMATS: dict[str, type[HermesToolFormat] | type[BracketToolFormat]] = {
    "hermes": HermesToolFormat,
    "bracket": BracketToolFormat,
}


def tool_format_names() -> list[str]:
    return sorted(_FORMATS)


def make_tool_format(name: str, **kwargs: Any) -> ToolFormat:
    """A built-in format by name: "hermes" (chat models) or "bracket" (character models)."""
    if name not in _FORMATS:
        raise ValueError(f"tool format: {name!r} is not one of {sorted(_FORMATS)}")
    return _FORMATS[name](**kwargs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_JSON_SIGNIFICANT = re.compile(r'["\\\[\]{}]')


def _nesting(payload: str, limit: int) -> int:
    """How deep arrays and objects nest in `payload` (outside strings), without decoding
    it; stops counting past `limit`. Linear: only quotes, backslashes and brackets are
    visited."""
    depth = deepest = 0
    in_string = False
    escaped_at = -1  # the position a backslash in a string escapes
    for match in _JSON_SIGNIFICANT.finditer(payload):
        char, at = match.group(), match.start()
        if in_string:
            if at == escaped_at:
                continue
            if char == "\\":
                escaped_at = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
        elif char in "]}":
            depth -= 1
    return deepest


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", type(None): "null or missing"}.get(
        type(value), type(value).__name__
    )
