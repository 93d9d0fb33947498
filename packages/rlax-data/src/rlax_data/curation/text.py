"""Text views of records shared by the curation passes."""

from __future__ import annotations

import re
import unicodedata

from rlax_data.datasets import Record

__all__ = ["normalize_text", "record_text", "shingles", "word_ngrams"]

_PUNCT = re.compile(r"[^\w\s]", re.UNICODE)


def record_text(record: Record) -> str:
    """The prompt text, or the chat messages' contents joined by newlines."""
    if record.prompt is not None:
        return record.prompt
    return "\n".join(m.content for m in record.messages or [])


def normalize_text(text: str) -> str:
    """NFKC, lowercased, punctuation removed, whitespace collapsed: what "the same text" means."""
    s = unicodedata.normalize("NFKC", text).lower()
    s = _PUNCT.sub(" ", s)
    return " ".join(s.split())


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Word n-grams of the normalised text; a text shorter than n words is one gram."""
    words = normalize_text(text).split()
    if not words:
        return set()
    if len(words) < n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def shingles(text: str, n: int) -> set[str]:
    """Character n-gram shingles of the normalised text (robust for short prompts)."""
    s = normalize_text(text)
    if len(s) <= n:
        return {s} if s else set()
    return {s[i : i + n] for i in range(len(s) - n + 1)}
