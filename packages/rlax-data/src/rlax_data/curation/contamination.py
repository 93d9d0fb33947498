"""Contamination: training prompts that share word n-grams with an evaluation set."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from rlax_data.curation.text import record_text, word_ngrams
from rlax_data.datasets import Record

__all__ = ["ContaminationConfig", "ContaminationReport", "find_contamination"]


class ContaminationConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """n: words per n-gram (13 as in GPT-3's decontamination; texts shorter than n are one
    gram). min_overlap: fraction of a record's n-grams found in the evaluation set at
    which it counts as contaminated."""

    n: int = 13
    min_overlap: float = 0.5

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"field `n`: must be >= 1, got {self.n}")
        if not 0.0 < self.min_overlap <= 1.0:
            raise ValueError(f"field `min_overlap`: must be in (0, 1], got {self.min_overlap}")


class ContaminationReport(msgspec.Struct, kw_only=True):
    """flagged: {train id: {"overlap": fraction, "eval_ids": [...]}}."""

    total: int
    kept: int
    n: int
    flagged: dict[str, dict[str, object]]


def find_contamination(
    records: Sequence[Record], eval_records: Sequence[Record], config: ContaminationConfig | None = None
) -> tuple[list[Record], ContaminationReport]:
    """Split `records` into clean ones and a report of those overlapping `eval_records`."""
    cfg = config or ContaminationConfig()
    index: dict[tuple[str, ...], set[str]] = {}
    for e in eval_records:
        for g in word_ngrams(record_text(e), cfg.n):
            index.setdefault(g, set()).add(e.id)
    kept: list[Record] = []
    flagged: dict[str, dict[str, object]] = {}
    for r in records:
        grams = word_ngrams(record_text(r), cfg.n)
        hits = [g for g in grams if g in index]
        frac = len(hits) / len(grams) if grams else 0.0
        if hits and frac >= cfg.min_overlap:
            eval_ids = sorted({i for g in hits for i in index[g]})
            flagged[r.id] = {"overlap": round(frac, 4), "eval_ids": eval_ids[:20]}
        else:
            kept.append(r)
    return kept, ContaminationReport(total=len(records), kept=len(kept), n=cfg.n, flagged=flagged)
