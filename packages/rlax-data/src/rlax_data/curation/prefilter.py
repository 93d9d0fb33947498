"""Pass-rate pre-filtering: keep prompts the current model sometimes, but not always, solves.

For each prompt the sampler draws n completions; the verifier scores them; a prompt is
kept when `lower < pass rate < upper` (both strict). Kept records get their pass rate in
`metadata["pass_rate"]` (which `difficulty_buckets` reads). The curated set and a JSON
report are written atomically.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import msgspec

from rlax_data._io import atomic_write_json
from rlax_data.datasets import Record, write_jsonl
from rlax_data.sampling import PromptRenderer, Sampler, check_samples, render_prompts
from rlax_data.verify.base import Verifier

__all__ = ["PassRateConfig", "PrefilterReport", "prefilter_by_pass_rate"]


class PassRateConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    n: int = 8
    lower: float = 0.0
    upper: float = 1.0
    batch_size: int = 64

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"field `n`: must be >= 1, got {self.n}")
        if not 0.0 <= self.lower < self.upper <= 1.0:
            raise ValueError(
                f"fields `lower`, `upper`: need 0 <= lower < upper <= 1, got {self.lower}, {self.upper}"
            )
        if self.batch_size < 1:
            raise ValueError(f"field `batch_size`: must be >= 1, got {self.batch_size}")


class PrefilterReport(msgspec.Struct, kw_only=True):
    """pass_rates: id -> correct / n for every prompt. histogram: number of correct
    samples (0..n) -> number of prompts."""

    total: int
    kept: int
    n: int
    lower: float
    upper: float
    too_hard: int
    too_easy: int
    histogram: dict[str, int]
    pass_rates: dict[str, float]


def prefilter_by_pass_rate(
    records: Sequence[Record],
    sampler: Sampler,
    verifier: Verifier,
    config: PassRateConfig | None = None,
    *,
    render: PromptRenderer | None = None,
    out_path: str | os.PathLike[str] | None = None,
    report_path: str | os.PathLike[str] | None = None,
) -> tuple[list[Record], PrefilterReport]:
    """Sample, score and keep prompts with a pass rate strictly between the bounds."""
    cfg = config or PassRateConfig()
    kept: list[Record] = []
    rates: dict[str, float] = {}
    hist = {str(c): 0 for c in range(cfg.n + 1)}
    too_hard = too_easy = 0
    for start in range(0, len(records), cfg.batch_size):
        chunk = records[start : start + cfg.batch_size]
        samples = sampler(render_prompts(chunk, render), cfg.n)
        check_samples(samples, len(chunk), cfg.n)
        results = verifier.verify([(s, r) for r, row in zip(chunk, samples) for s in row])
        for j, record in enumerate(chunk):
            correct = sum(res.correct for res in results[j * cfg.n : (j + 1) * cfg.n])
            rate = correct / cfg.n
            rates[record.id] = rate
            hist[str(correct)] += 1
            if rate <= cfg.lower:
                too_hard += 1
            elif rate >= cfg.upper:
                too_easy += 1
            else:
                kept.append(msgspec.structs.replace(record, metadata={**record.metadata, "pass_rate": rate}))
    report = PrefilterReport(
        total=len(records),
        kept=len(kept),
        n=cfg.n,
        lower=cfg.lower,
        upper=cfg.upper,
        too_hard=too_hard,
        too_easy=too_easy,
        histogram=hist,
        pass_rates=rates,
    )
    if out_path is not None:
        write_jsonl(kept, out_path)
    if report_path is not None:
        atomic_write_json(Path(report_path), report)
    return kept, report
