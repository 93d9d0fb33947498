"""Llama 3.1-3.3 JSON tool calls: `{"name": ..., "parameters": {...}}`, results in the
`ipython` role."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_data.envs.tool_formats.base import MalformedCall, ParsedCall, ToolCallError, check_max_calls
from rlax_data.envs.tool_formats.json_text import call_from_object, decode_json, split_top_level
from rlax_data.envs.tools import ToolCall, ToolResult

__all__ = ["Llama3JsonToolFormat"]


class Llama3JsonToolFormat:
    """Llama 3.x custom-tool calls: the whole turn is `{"name": ..., "parameters": {...}}`
    (Meta's key; "arguments" is read too), optionally after the `<|python_tag|>` special
    token; several calls are separated by `;`, as vLLM's `llama3_json` parser reads them.

    A turn is a call when it holds `<|python_tag|>` (text before the tag is ignored) or,
    without the tag, when it starts with `{` (leading whitespace aside): a final answer that
    is itself a JSON object reads as a call. Each `;`-separated piece is decoded on its own,
    so a garbled piece is a `MalformedCall` in its place; a trailing `;` is allowed. Meta's
    built-in tools (`brave_search.call(...)`, raw code after the tag) are not read: they are
    malformed calls here.

    The result is the tool's text; the chat template puts it in an `ipython` message
    (Meta's template JSON-encodes it, which `rlax_data.agent_turns` reads off the
    template). The turn ends with the model's end-of-turn token (`call_stop` is empty): a
    JSON call has no closing text to stop on. (`<|eom_id|>`, which Meta's models write
    after a built-in tool's call, is not that token: a run stops on the tokenizer's
    end-of-sequence token, `<|eot_id|>` in the instruct models.)

    max_calls: calls per turn. max_call_chars: the longest JSON text of one call decoded;
    max_depth: the deepest nesting of objects and arrays allowed in it.
    """

    TAG = "<|python_tag|>"
    call_stop = ""
    special_markers: tuple[str, ...] = (TAG,)

    def __init__(self, *, max_calls: int = 1, max_call_chars: int = 65536, max_depth: int = 32) -> None:
        self.max_calls = check_max_calls("Llama3JsonToolFormat", max_calls)
        self.max_call_chars = max_call_chars
        self.max_depth = max_depth

    def parse(self, turn_text: str) -> list[ParsedCall]:
        tag = turn_text.find(self.TAG)
        if tag >= 0:
            body = turn_text[tag + len(self.TAG) :]
            if not body.strip():
                return [MalformedCall(f"{self.TAG} without a call after it")]
        else:
            body = turn_text.lstrip()
            if not body.startswith("{"):
                return []
        pieces = split_top_level(body, ";")
        if len(pieces) > 1 and not pieces[-1].strip():
            pieces.pop()  # "call; call;": the last `;` ends the list
        return [self._read(piece.strip()) for piece in pieces]

    def _read(self, piece: str) -> ParsedCall:
        if not piece:
            return MalformedCall("an empty call between ';'")
        try:
            data = decode_json(piece, max_chars=self.max_call_chars, max_depth=self.max_depth)
            return call_from_object(data, arguments_keys=("parameters", "arguments"))
        except ToolCallError as error:
            return MalformedCall(str(error))

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(
            json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls
        )

    def render_call(self, call: ToolCall) -> str:
        return self.render_calls([call])

    def render_result(self, result: ToolResult) -> str:
        return result.text

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        several = (
            f" To call several functions at once (at most {self.max_calls}), separate the JSON objects with ';'."
            if self.max_calls > 1
            else ""
        )
        specs = "\n\n".join(json.dumps(t, indent=4) for t in tools)
        return (
            "You have access to the following functions. To call a function, reply with only a "
            'JSON object of the form {"name": function name, "parameters": dictionary of '
            f"argument name and its value}}.{several} Its result comes back in the next message.\n\n{specs}"
        )
