"""Answer-checking verifiers: normalised exact match and math equivalence (math-verify)."""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from rlax_data.datasets import Record
from rlax_data.verify.base import VerifyItem, VerifyResult

__all__ = [
    "ExactMatchConfig",
    "ExactMatchVerifier",
    "MathConfig",
    "MathVerifier",
    "extract_answer",
    "normalize_answer",
]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced; None if absent."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


Extract = Literal["first_line", "full", "boxed", "last_line"]


def extract_answer(text: str, how: Extract) -> str | None:
    """Pull the answer out of a completion: its first / last non-empty line, the whole
    text, or the last `\\boxed{}`. None when there is nothing to extract."""
    if how == "full":
        return text
    if how == "boxed":
        return _last_boxed(text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    return lines[0] if how == "first_line" else lines[-1]


def normalize_answer(text: str, *, case_sensitive: bool = False) -> str:
    """NFKC, trimmed, inner whitespace collapsed, a trailing period dropped, lowercased
    unless `case_sensitive`."""
    s = unicodedata.normalize("NFKC", text).strip()
    s = re.sub(r"\s+", " ", s)
    s = s.rstrip(".").strip()
    return s if case_sensitive else s.lower()


def _require_answer(record: Record) -> str:
    if record.answer is None:
        raise ValueError(f"record {record.id!r}: field `answer` is required by this verifier")
    return record.answer


class ExactMatchConfig(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind", tag="exact"
):
    """Normalised exact match of the extracted answer against `record.answer`."""

    extract: Extract = "first_line"
    case_sensitive: bool = False


class ExactMatchVerifier:
    def __init__(self, config: ExactMatchConfig | None = None) -> None:
        self.config = config or ExactMatchConfig()

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        out = []
        cs = self.config.case_sensitive
        for completion, record in items:
            gold = normalize_answer(_require_answer(record), case_sensitive=cs)
            got = extract_answer(completion, self.config.extract)
            if got is None:
                out.append(VerifyResult(reward=0.0, correct=False, details={"reason": "no answer found"}))
                continue
            pred = normalize_answer(got, case_sensitive=cs)
            ok = pred == gold
            out.append(VerifyResult(reward=float(ok), correct=ok, details={"extracted": pred}))
        return out


class MathConfig(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind", tag="math"
):
    """Math-answer equivalence through math-verify.

    The prediction is searched for a `\\boxed{}` answer first, then the last LaTeX or plain
    expression. timeout_s: math-verify's per-call limit, which uses SIGALRM and so works
    only on the main thread; set it to None to call from other threads (then no limit).
    """

    timeout_s: int | None = 5
    float_rounding: int = 6
    strict: bool = True
    boxed_only: bool = False

    def __post_init__(self) -> None:
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"field `timeout_s`: must be > 0 or null, got {self.timeout_s}")


class MathVerifier:
    """Scores math answers: 1.0 when math-verify finds the prediction equivalent to the gold."""

    def __init__(self, config: MathConfig | None = None) -> None:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig

        self.config = config or MathConfig()
        self._gold_cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
        latex = LatexExtractionConfig(boxed_match_priority=0)
        self._pred_cfg = [latex] if self.config.boxed_only else [latex, ExprExtractionConfig()]
        self._gold_cache: dict[str, Any] = {}

    def _timeout(self) -> int | None:
        t = self.config.timeout_s
        if t is not None and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "MathVerifier with `timeout_s` set must run on the main thread (math-verify uses "
                "SIGALRM); set `timeout_s: null` to verify from another thread"
            )
        return t

    def _parse_gold(self, answer: str) -> Any:
        from math_verify import parse

        if answer not in self._gold_cache:
            # Gold answers are often bare ("1/2", "\\frac{1}{2}"): wrap them so the LaTeX
            # extractor sees math mode.
            text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
            parsed = parse(text, self._gold_cfg, parsing_timeout=self._timeout())
            if not parsed:
                parsed = parse(answer, self._gold_cfg, parsing_timeout=self._timeout())
            if len(self._gold_cache) > 100_000:
                self._gold_cache.clear()
            self._gold_cache[answer] = parsed
        return self._gold_cache[answer]

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        from math_verify import parse, verify

        out = []
        for completion, record in items:
            gold = self._parse_gold(_require_answer(record))
            if not gold:
                raise ValueError(
                    f"record {record.id!r}: math-verify cannot parse field `answer` {record.answer!r}"
                )
            pred = parse(completion, self._pred_cfg, parsing_timeout=self._timeout())
            if not pred:
                out.append(VerifyResult(reward=0.0, correct=False, details={"reason": "no answer found"}))
                continue
            ok = bool(
                verify(
                    gold,
                    pred,
                    float_rounding=self.config.float_rounding,
                    strict=self.config.strict,
                    timeout_seconds=self._timeout(),
                )
            )
            shown = str(pred[-1])
            out.append(VerifyResult(reward=float(ok), correct=ok, details={"extracted": shown}))
        return out
