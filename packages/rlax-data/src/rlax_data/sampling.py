"""The sampler seam: whatever generates completions (the inference engine, a test stub)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from rlax_data.datasets import Record

__all__ = ["PromptRenderer", "Sampler", "render_prompts"]


@runtime_checkable
class Sampler(Protocol):
    """prompts: [batch] str, n samples each -> [batch][n] completion texts."""

    def __call__(self, prompts: Sequence[str], n: int) -> list[list[str]]: ...


PromptRenderer = Callable[[Record], str]
"""Record -> prompt text (a chat template for records with `messages`)."""


def render_prompts(records: Sequence[Record], render: PromptRenderer | None = None) -> list[str]:
    """Prompt texts of `records`; records with chat messages need `render`."""
    if render is not None:
        return [render(r) for r in records]
    return [r.prompt_text() for r in records]


def check_samples(out: list[list[str]], batch: int, n: int) -> None:
    """A sampler must return [batch][n] strings; anything else is a bug worth naming."""
    if len(out) != batch or any(len(row) != n for row in out):
        shape = [len(row) for row in out][:8]
        raise ValueError(f"sampler returned {len(out)} rows with lengths {shape}..., expected [{batch}][{n}]")
