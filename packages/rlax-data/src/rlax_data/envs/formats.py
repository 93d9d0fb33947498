"""How a model writes tool calls and reads their results, as text: the formats by name,
and the one a chat template was made for.

A format parses a model turn into its calls, in order (`ToolCall`s, and a `MalformedCall`
in the place of each call it cannot read; none for a final answer), and renders calls (for
SFT demonstrations) and results (the next environment turn). The formats live in
`rlax_data.envs.tool_formats`, one module per model family.

Parsing is the model's untrusted text: sizes are checked before any JSON is decoded,
decoded structures are checked for depth, and a hostile turn costs linear time at most.
"""

from __future__ import annotations

from typing import Any

from rlax_data.envs.tool_formats import (
    BracketToolFormat,
    HermesToolFormat,
    Llama3JsonToolFormat,
    MalformedCall,
    MistralToolFormat,
    ParsedCall,
    ToolCallError,
    ToolFormat,
)

__all__ = [
    "BracketToolFormat",
    "HermesToolFormat",
    "Llama3JsonToolFormat",
    "MalformedCall",
    "MistralToolFormat",
    "ParsedCall",
    "ToolCallError",
    "ToolFormat",
    "make_tool_format",
    "tool_format_for_template",
    "tool_format_names",
]

_FORMATS: dict[str, Any] = {
    "bracket": BracketToolFormat,
    "hermes": HermesToolFormat,
    "llama3_json": Llama3JsonToolFormat,
    "mistral": MistralToolFormat,
}

# What only one family's chat templates hold: Mistral's tool tokens, the `ipython` role of
# Llama 3.1+ (or its <|python_tag|>), the tags of Hermes / Qwen. A template without any
# (SmolLM2's ChatML has no tool syntax) names no format.
_TEMPLATE_SIGNS: dict[str, tuple[str, ...]] = {
    "mistral": ("[TOOL_CALLS]", "[TOOL_RESULTS]"),
    "llama3_json": ("<|python_tag|>", "ipython"),
    "hermes": ("<tool_call>", "<tool_response>"),
}


def tool_format_names() -> list[str]:
    return sorted(_FORMATS)


def make_tool_format(name: str, **kwargs: Any) -> ToolFormat:
    """A built-in format by name: "hermes" (Hermes / Qwen chat models), "llama3_json"
    (Llama 3.x), "mistral" or "bracket" (the character-level tiny model). `kwargs` go to
    its constructor (`max_calls`, every format's calls per turn, among them)."""
    if name not in _FORMATS:
        raise ValueError(f"tool format: {name!r} is not one of {sorted(_FORMATS)}")
    fmt: ToolFormat = _FORMATS[name](**kwargs)
    return fmt


def tool_format_for_template(template_source: str | None) -> str | None:
    """The name of the call format a chat template was written for, read off its text:
    "mistral" (`[TOOL_CALLS]`), "llama3_json" (the `ipython` role, `<|python_tag|>`),
    "hermes" (`<tool_call>`, `<tool_response>`); None when it holds none of them (or there
    is no template). A template holding the signs of several families is ambiguous: a
    `ValueError` asks for the format to be named."""
    if not template_source:
        return None
    found = [name for name, signs in _TEMPLATE_SIGNS.items() if any(s in template_source for s in signs)]
    if len(found) > 1:
        raise ValueError(
            f"the chat template holds the tool syntax of several formats {found}; name one in agent.tool_format"
        )
    return found[0] if found else None
