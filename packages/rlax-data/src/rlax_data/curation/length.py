"""Length filter: drop records whose prompt (or reference answer) is too many tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from rlax_data.curation.text import record_text
from rlax_data.datasets import Record

__all__ = ["LengthReport", "Tokenize", "filter_by_length"]

Tokenize = Callable[[str], Sequence[int]]
"""Any tokenizer: text -> token ids."""


class LengthReport(msgspec.Struct, kw_only=True):
    """Prompt-length percentiles (tokens) before filtering, and the ids dropped."""

    total: int
    kept: int
    prompt_tokens: dict[str, float]
    too_long_prompt: list[str]
    too_long_answer: list[str]


def filter_by_length(
    records: Sequence[Record],
    tokenize: Tokenize,
    *,
    max_prompt_tokens: int,
    max_answer_tokens: int | None = None,
) -> tuple[list[Record], LengthReport]:
    """Keep records with at most `max_prompt_tokens` prompt tokens (and, if given, at most
    `max_answer_tokens` tokens in `answer`)."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens: must be >= 1, got {max_prompt_tokens}")
    kept, long_p, long_a, lengths = [], [], [], []
    for r in records:
        n = len(tokenize(record_text(r)))
        lengths.append(n)
        if n > max_prompt_tokens:
            long_p.append(r.id)
            continue
        if (
            max_answer_tokens is not None
            and r.answer is not None
            and len(tokenize(r.answer)) > max_answer_tokens
        ):
            long_a.append(r.id)
            continue
        kept.append(r)
    pct = {}
    if lengths:
        arr = np.asarray(lengths)
        pct = {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)} | {"max": float(arr.max())}
    return kept, LengthReport(
        total=len(records), kept=len(kept), prompt_tokens=pct, too_long_prompt=long_p, too_long_answer=long_a
    )
