"""Contamination: training records that contain (much of) an evaluation problem.

Texts are compared as normalised tokens (`text_tokens`: numbers, words, operators and
other symbols; case, spacing and prose punctuation ignored). For an evaluation problem
of at least `n` tokens, the measure is how much of *that problem* a training record
holds: the fraction of the problem's token n-grams that occur anywhere in the record
(13-grams, as in GPT-3's and OLMo's decontamination). Measured against the problem and
not against the record, a problem pasted into a long training text still counts as
fully present. A problem shorter than `n` tokens has no n-gram, so it counts as present
when the record contains its whole token sequence, contiguously.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec

from rlax_data.curation.text import record_text, text_tokens
from rlax_data.datasets import Record

__all__ = ["ContaminationConfig", "ContaminationReport", "find_contamination"]


class ContaminationConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """n: tokens per n-gram (13 as in GPT-3's decontamination). min_overlap: fraction of
    an evaluation problem's n-grams found in a training record at which the record counts
    as contaminated by it. Problems shorter than n tokens need their whole text."""

    n: int = 13
    min_overlap: float = 0.5

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"field `n`: must be >= 1, got {self.n}")
        if not 0.0 < self.min_overlap <= 1.0:
            raise ValueError(f"field `min_overlap`: must be in (0, 1], got {self.min_overlap}")


class ContaminationReport(msgspec.Struct, kw_only=True):
    """flagged: {train id: {"overlap": the largest fraction of one evaluation problem
    found in it, "eval_ids": the problems at or above `min_overlap` (at most 20)}}."""

    total: int
    kept: int
    n: int
    flagged: dict[str, dict[str, object]]


def _ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


class _EvalIndex:
    """Every evaluation problem, indexed for the two checks."""

    def __init__(self, eval_records: Sequence[Record], n: int) -> None:
        self.n = n
        self.grams: dict[tuple[str, ...], set[str]] = {}  # n-gram -> ids of long problems holding it
        self.gram_count: dict[str, int] = {}  # long problem id -> its number of distinct n-grams
        self.short: dict[tuple[str, ...], set[str]] = {}  # whole token sequence -> ids of short problems
        self.short_lengths: dict[str, set[int]] = {}  # first token -> lengths of short problems starting so
        for e in eval_records:
            tokens = text_tokens(record_text(e))
            if not tokens:
                continue
            if len(tokens) < n:
                self.short.setdefault(tuple(tokens), set()).add(e.id)
                self.short_lengths.setdefault(tokens[0], set()).add(len(tokens))
                continue
            grams = _ngrams(tokens, n)
            self.gram_count[e.id] = len(grams)
            for g in grams:
                self.grams.setdefault(g, set()).add(e.id)

    def coverage(self, tokens: Sequence[str]) -> dict[str, float]:
        """{eval id: fraction of that problem found in `tokens`} for every problem seen."""
        hits: Counter[str] = Counter()
        for g in _ngrams(tokens, self.n):
            hits.update(self.grams.get(g, ()))
        found = {eid: min(1.0, c / self.gram_count[eid]) for eid, c in hits.items()}
        # Only positions that start like some short problem can hold one.
        for i, token in enumerate(tokens):
            for length in self.short_lengths.get(token, ()):
                for eid in self.short.get(tuple(tokens[i : i + length]), ()):
                    found[eid] = 1.0
        return found


def find_contamination(
    records: Sequence[Record], eval_records: Sequence[Record], config: ContaminationConfig | None = None
) -> tuple[list[Record], ContaminationReport]:
    """Split `records` into clean ones and a report of those holding an `eval_records` problem."""
    cfg = config or ContaminationConfig()
    index = _EvalIndex(eval_records, cfg.n)
    kept: list[Record] = []
    flagged: dict[str, dict[str, object]] = {}
    for r in records:
        found = index.coverage(text_tokens(record_text(r)))
        leaked = sorted(eid for eid, frac in found.items() if frac >= cfg.min_overlap)
        if leaked:
            flagged[r.id] = {"overlap": round(max(found[e] for e in leaked), 4), "eval_ids": leaked[:20]}
        else:
            kept.append(r)
    return kept, ContaminationReport(total=len(records), kept=len(kept), n=cfg.n, flagged=flagged)
