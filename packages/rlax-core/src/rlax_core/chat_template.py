"""Chat-template rendering with jinja2 in a sandbox (templates come from checkpoint files)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template failed to compile or to render; the message says where."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. `render(messages, add_generation_prompt=..., **extra) -> str`.

    Rendering follows the conventions HF templates are written for: `trim_blocks` and
    `lstrip_blocks`, `raise_exception`, a `tojson` filter, `strftime_now`; `bos_token` and
    `eos_token` (and any `extra` keyword) are template variables.
    """

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template line {e.lineno}: {e.message}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render `messages` (each with at least "role" and "content") to the prompt text."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ChatTemplateError(
                    f"messages[{i}] must be a mapping with 'role' and 'content', got {m!r}"
                )
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from None
