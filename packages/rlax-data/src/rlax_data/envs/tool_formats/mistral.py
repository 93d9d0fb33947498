"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, results in
`[TOOL_RESULTS]...[/TOOL_RESULTS]`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_data.envs.tool_formats.base import MalformedCall, ParsedCall, ToolCallError, check_max_calls
from rlax_data.envs.tool_formats.json_text import call_from_object, decode_json, split_top_level
from rlax_data.envs.tools import ToolCall, ToolResult

__all__ = ["MistralToolFormat"]


class MistralToolFormat:
    """Mistral's calls (the v3 tokenizers' format: Mistral 7B v0.3, Nemo, Small 2409):
    the `[TOOL_CALLS]` special token, then one JSON list holding every call of the turn,
    `[{"name": ..., "arguments": {...}}, ...]` (an `"id"` key in a call is allowed and
    ignored). Text before `[TOOL_CALLS]` is allowed; the list must end the turn.

    The list is cut into its elements without decoding it (commas outside strings and
    brackets) and each element is decoded on its own, so a garbled call is a
    `MalformedCall` in its place and the others still run; a list that cannot be cut (no
    `[`, no closing `]`, a second `[TOOL_CALLS]`) is one `MalformedCall`. The newer
    `[TOOL_CALLS]name[ARGS]{...}` form (tekken v11 and later) is not read.

    The result is the tool's text; `[TOOL_RESULTS]` and `[/TOOL_RESULTS]` are special
    tokens, so they come from the chat template's tool message, never from the result's
    text (a tool cannot forge them). The turn ends with the model's end-of-sequence token
    (`call_stop` is empty: the list has no closing text of its own to stop on).

    max_calls: calls per turn. max_call_chars: the longest JSON text of one call decoded;
    max_depth: the deepest nesting of objects and arrays allowed in it.
    """

    CALLS = "[TOOL_CALLS]"
    call_stop = ""
    special_markers: tuple[str, ...] = (CALLS,)

    def __init__(self, *, max_calls: int = 1, max_call_chars: int = 65536, max_depth: int = 32) -> None:
        self.max_calls = check_max_calls("MistralToolFormat", max_calls)
        self.max_call_chars = max_call_chars
        self.max_depth = max_depth

    def parse(self, turn_text: str) -> list[ParsedCall]:
        at = turn_text.find(self.CALLS)
        if at < 0:
            return []
        body = turn_text[at + len(self.CALLS) :].strip()
        if self.CALLS in body:
            return [MalformedCall(f"{self.CALLS} more than once: write every call of the turn in one list")]
        if not body.startswith("["):
            return [
                MalformedCall(
                    f'{self.CALLS} must be followed by a JSON list [{{"name": ..., "arguments": {{...}}}}]'
                )
            ]
        if not body.endswith("]"):
            return [MalformedCall("the list of calls is not closed by ']', or text follows it")]
        inner = body[1:-1]
        if not inner.strip():
            return [MalformedCall("the list of calls is empty")]
        return [self._read(piece.strip()) for piece in split_top_level(inner, ",")]

    def _read(self, piece: str) -> ParsedCall:
        if not piece:
            return MalformedCall("an empty element in the list of calls")
        try:
            data = decode_json(piece, max_chars=self.max_call_chars, max_depth=self.max_depth)
            return call_from_object(data, arguments_keys=("arguments",), optional=("id",))
        except ToolCallError as error:
            return MalformedCall(str(error))

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        listed = [{"name": c.name, "arguments": c.arguments} for c in calls]
        return self.CALLS + json.dumps(listed, ensure_ascii=False)

    def render_call(self, call: ToolCall) -> str:
        return self.render_calls([call])

    def render_result(self, result: ToolResult) -> str:
        return result.text

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return (
            f"You may call these functions:\n{json.dumps(list(tools))}\n"
            f"To call them, reply with {self.CALLS} followed by a JSON list of calls, "
            '[{"name": function name, "arguments": {argument name: value}}], '
            f"at most {self.max_calls} in one reply. Each result comes back in its own message, in order."
        )
