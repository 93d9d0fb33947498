"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_data.envs.tool_formats.base import MalformedCall, ParsedCall, ToolCallError, check_max_calls
from rlax_data.envs.tool_formats.json_text import call_from_object, decode_json
from rlax_data.envs.tools import ToolCall, ToolResult

__all__ = ["HermesToolFormat"]


class HermesToolFormat:
    """Hermes / Qwen style: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    Text before the first `<tool_call>` (the model's reasoning) is allowed; between and
    after the calls only whitespace. A turn may hold several calls; each is read on its own,
    so a garbled one is a `MalformedCall` in its place and the others still run. Stray text
    between or after calls is a `MalformedCall` where it stands. A result is its text alone:
    the chat template frames a tool message (Qwen's adds the `<tool_response>` tags itself,
    SmolLM2's opens a `tool` turn), which is the worker's job (`rlax_data.agent_turns`). Tags
    written here as well would be doubled in Qwen's prompts, and in SmolLM2's they taught
    the model to write a `<tool_response>` of its own instead of a call: 1 of 64 replies
    called the calculator after a worked example whose result was tagged, 19 of 64 after
    the same example untagged.

    max_calls: calls per turn. With 1 a turn stops at `</tool_call>` (the cheapest turn
    for a model that writes one call and waits); with more, `call_stop` is empty and the
    model's end-of-turn token ends the turn. max_call_chars: the longest JSON payload of one
    call decoded; max_depth: the deepest nesting of objects and arrays allowed in it.
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    special_markers: tuple[str, ...] = ()

    def __init__(self, *, max_calls: int = 1, max_call_chars: int = 65536, max_depth: int = 32) -> None:
        self.max_calls = check_max_calls("HermesToolFormat", max_calls)
        self.call_stop = self.CLOSE if max_calls == 1 else ""
        self.max_call_chars = max_call_chars
        self.max_depth = max_depth

    def parse(self, turn_text: str) -> list[ParsedCall]:
        # Each search starts where the last one ended: linear in the turn.
        start = turn_text.find(self.OPEN)
        if start < 0:
            return [MalformedCall(f"{self.CLOSE} without {self.OPEN}")] if self.CLOSE in turn_text else []
        calls: list[ParsedCall] = []
        if self.CLOSE in turn_text[:start]:
            calls.append(MalformedCall(f"{self.CLOSE} before {self.OPEN}"))
        while True:
            body = start + len(self.OPEN)
            end = turn_text.find(self.CLOSE, body)
            if end < 0:
                calls.append(MalformedCall(f"{self.OPEN} is not closed by {self.CLOSE}"))
                return calls
            payload = turn_text[body:end]
            if self.OPEN in payload:
                calls.append(MalformedCall(f"{self.OPEN} inside a call"))
            else:
                calls.append(self._read(payload))
            after = end + len(self.CLOSE)
            start = turn_text.find(self.OPEN, after)
            if start < 0:
                if turn_text[after:].strip():
                    calls.append(MalformedCall(f"text after {self.CLOSE}: end the turn after the calls"))
                return calls
            if turn_text[after:start].strip():
                calls.append(
                    MalformedCall(
                        f"text between calls: only whitespace may separate {self.CLOSE} and {self.OPEN}"
                    )
                )

    def _read(self, payload: str) -> ParsedCall:
        try:
            data = decode_json(payload.strip(), max_chars=self.max_call_chars, max_depth=self.max_depth)
            return call_from_object(data, arguments_keys=("arguments",))
        except ToolCallError as error:
            return MalformedCall(str(error))

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f"{self.OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}\n{self.CLOSE}"
            for c in calls
        )

    def render_call(self, call: ToolCall) -> str:
        return self.render_calls([call])

    def render_result(self, result: ToolResult) -> str:
        return result.text

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return (
            "You may call one or more functions to assist with the user query. The functions "
            f"you may call are listed in <tools></tools>:\n<tools>\n{json.dumps(list(tools))}\n</tools>\n"
            "For a call, reply with a JSON object naming the function and its arguments within "
            '<tool_call></tool_call> tags: <tool_call>{"name": <function-name>, "arguments": '
            "<args-json-object>}</tool_call>. Its result comes back in the tool's message."
            + (
                f" You may make up to {self.max_calls} calls in one reply, each in its own tags; "
                "their results come back in the same order."
                if self.max_calls > 1
                else ""
            )
        )
