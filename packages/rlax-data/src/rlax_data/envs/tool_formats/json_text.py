"""JSON written by a model, read at bounded cost.

Every helper here is linear in its input: sizes are checked before `json.loads` sees a
payload, nesting depth is counted without decoding (the decoder recurses once per level),
and a turn holding several calls is cut into them by one scan that skips strings, so one
garbled call does not swallow the calls after it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from typing import Any

from rlax_data.envs.tool_formats.base import ToolCallError
from rlax_data.envs.tools import ToolCall

__all__ = ["call_from_object", "decode_json", "kind_of", "nesting", "split_top_level"]

_SIGNIFICANT = '"\\\\\\[\\]{}'  # a character class body: quote, backslash, brackets, braces
_NESTING = re.compile(f"[{_SIGNIFICANT}]")
_SPLITTERS: dict[str, re.Pattern[str]] = {}


def _outside_strings(text: str, pattern: re.Pattern[str]) -> Iterator[tuple[str, int]]:
    """The characters `pattern` finds in `text` that stand outside JSON strings (with their
    positions); quotes and backslashes are consumed here. Linear."""
    in_string = False
    escaped_at = -1  # the position a backslash in a string escapes
    for match in pattern.finditer(text):
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
        else:
            yield char, at


def nesting(payload: str, limit: int) -> int:
    """How deep arrays and objects nest in `payload` (outside strings), without decoding
    it; stops counting past `limit`. Linear: only quotes, backslashes and brackets are
    visited."""
    depth = deepest = 0
    for char, _ in _outside_strings(payload, _NESTING):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
        elif char in "]}":
            depth -= 1
    return deepest


def split_top_level(text: str, separator: str) -> list[str]:
    """`text` cut at every `separator` (one character) that is outside strings, arrays and
    objects: `'{"a": ";"}; {"b": 1}'` on ";" gives two pieces. Linear. Unbalanced text is
    still cut somewhere (a stray closing bracket counts as none); its pieces fail to decode
    one by one."""
    if len(separator) != 1 or separator in '"\\[]{}':
        raise ValueError(f"split_top_level: the separator must be one plain character, got {separator!r}")
    pattern = _SPLITTERS.get(separator)
    if pattern is None:
        pattern = _SPLITTERS.setdefault(separator, re.compile(f"[{_SIGNIFICANT}{re.escape(separator)}]"))
    pieces: list[str] = []
    start = depth = 0
    for char, at in _outside_strings(text, pattern):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(0, depth - 1)
        elif depth == 0:  # the separator, outside everything
            pieces.append(text[start:at])
            start = at + 1
    pieces.append(text[start:])
    return pieces


def decode_json(payload: str, *, max_chars: int, max_depth: int) -> Any:
    """`payload` decoded, after its size and nesting were checked; `ToolCallError` says
    what is wrong (NaN and Infinity are not JSON here)."""
    if len(payload) > max_chars:
        raise ToolCallError(f"the call is longer than {max_chars} characters")
    too_deep = f"the call's JSON is nested deeper than {max_depth} levels"
    if nesting(payload, max_depth) > max_depth:
        raise ToolCallError(too_deep)
    try:
        return json.loads(payload, parse_constant=_reject_constant)
    except RecursionError:  # pragma: no cover - the nesting check comes first
        raise ToolCallError(too_deep) from None
    except ValueError as e:  # JSONDecodeError, NaN, ints beyond Python's digit limit
        raise ToolCallError(f"the call is not valid JSON ({e})") from None


def call_from_object(
    data: Any, *, arguments_keys: tuple[str, ...], optional: Collection[str] = ()
) -> ToolCall:
    """The `ToolCall` a decoded JSON object stands for: `{"name": str, KEY: {...}}` with
    exactly one of `arguments_keys` (Llama writes "parameters" where others write
    "arguments") and nothing else but the `optional` keys (ignored)."""
    shape = '{"name": ..., "' + arguments_keys[0] + '": {...}}'
    if type(data) is not dict:
        raise ToolCallError(f"the call must be a JSON object {shape}, not {kind_of(data)}")
    allowed = {"name", *arguments_keys, *optional}
    extra = sorted(set(data) - allowed)
    if extra:
        only = " and ".join(["name", *arguments_keys[:1]])
        raise ToolCallError(f"the call has unexpected keys {extra[:5]}; it takes only {only}")
    given = [key for key in arguments_keys if key in data]
    if len(given) > 1:
        raise ToolCallError(f"the call has both {given[0]} and {given[1]}; write one of them")
    name = data.get("name")
    key = given[0] if given else arguments_keys[0]
    arguments = data.get(key)
    if type(name) is not str or not name:
        raise ToolCallError(f"the call's name must be a non-empty string, got {kind_of(name)}")
    if type(arguments) is not dict:
        raise ToolCallError(f"the call's {key} must be a JSON object, got {kind_of(arguments)}")
    return ToolCall(name=name, arguments=arguments)


def kind_of(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", type(None): "null or missing"}.get(
        type(value), type(value).__name__
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
