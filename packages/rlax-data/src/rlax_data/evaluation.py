"""pass@k, avg@k and maj@k, and an evaluation runner that writes JSON and a markdown table."""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from rlax_data._io import atomic_write_json, atomic_write_text
from rlax_data.datasets import Record
from rlax_data.sampling import PromptRenderer, Sampler, check_samples, render_prompts
from rlax_data.verify.base import Verifier, VerifyResult

__all__ = ["EvalReport", "avg_at_k", "evaluate", "maj_at_k", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def avg_at_k(correct: Sequence[bool], k: int) -> float:
    """Mean correctness of the first k samples of one prompt."""
    if not 1 <= k <= len(correct):
        raise ValueError(f"avg_at_k: need 1 <= k <= {len(correct)}, got {k}")
    return float(np.mean(np.asarray(correct[:k], dtype=np.float64)))


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 if the most common answer among the first k samples is a correct one.

    answers: the extracted answer of each sample (None when nothing was extracted; such
    samples do not vote). Ties go to the answer seen first.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj_at_k: need 1 <= k <= {len(answers)}, got {k}")
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return 0.0
    best = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == best)
    return float(any(ok for a, ok in zip(answers[:k], correct[:k]) if a == winner))


class EvalReport(msgspec.Struct, kw_only=True):
    """metrics[group][metric] for group "all" and each record `task`; per_prompt rows."""

    n: int
    ks: list[int]
    metrics: dict[str, dict[str, float]]
    counts: dict[str, int]
    per_prompt: list[dict[str, Any]]

    def markdown(self) -> str:
        names = [f"pass@{k}" for k in self.ks] + [f"avg@{k}" for k in self.ks] + [f"maj@{k}" for k in self.ks]
        lines = ["| group | prompts | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
        for group, m in self.metrics.items():
            cells = " | ".join(f"{m[name]:.4f}" for name in names)
            lines.append(f"| {group} | {self.counts[group]} | {cells} |")
        return "\n".join(lines) + "\n"


def _default_answer(completion: str, result: VerifyResult) -> str | None:
    got = result.details.get("extracted")
    if got is not None:
        return str(got)
    lines = [ln.strip() for ln in completion.splitlines() if ln.strip()]
    return lines[0] if lines else None


def evaluate(
    records: Sequence[Record],
    sampler: Sampler,
    verifier: Verifier,
    *,
    n: int,
    ks: Sequence[int] = (1,),
    batch_size: int = 64,
    render: PromptRenderer | None = None,
    answer_of: Callable[[str, VerifyResult], str | None] = _default_answer,
    out_dir: str | os.PathLike[str] | None = None,
) -> EvalReport:
    """Sample n completions per record, verify them, and compute pass@k, avg@k, maj@k
    for each k in `ks`, overall and per `record.task`. With `out_dir`, writes
    `eval.json` and `eval.md` there (atomically)."""
    ks = sorted(set(ks))
    if not records:
        raise ValueError("records: nothing to evaluate")
    if not ks or ks[0] < 1 or ks[-1] > n:
        raise ValueError(f"ks: every k must be in [1, n={n}], got {ks}")
    per_prompt: list[dict[str, Any]] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        samples = sampler(render_prompts(chunk, render), n)
        check_samples(samples, len(chunk), n)
        items = [(s, r) for r, row in zip(chunk, samples) for s in row]
        results = verifier.verify(items)
        for j, record in enumerate(chunk):
            rs = results[j * n : (j + 1) * n]
            correct = [r.correct for r in rs]
            answers = [answer_of(s, r) for s, r in zip(samples[j], rs)]
            row: dict[str, Any] = {"id": record.id, "task": record.task, "correct": sum(correct)}
            for k in ks:
                row[f"pass@{k}"] = pass_at_k(n, sum(correct), k)
                row[f"avg@{k}"] = avg_at_k(correct, k)
                row[f"maj@{k}"] = maj_at_k(answers, correct, k)
            per_prompt.append(row)
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in per_prompt:
        groups["all"].append(row)
        if row["task"]:
            groups[str(row["task"])].append(row)
    metric_names = [f"{m}@{k}" for m in ("pass", "avg", "maj") for k in ks]
    metrics = {
        g: {m: math.fsum(r[m] for r in rows) / len(rows) for m in metric_names} for g, rows in groups.items()
    }
    report = EvalReport(
        n=n,
        ks=list(ks),
        metrics=metrics,
        counts={g: len(rows) for g, rows in groups.items()},
        per_prompt=per_prompt,
    )
    if out_dir is not None:
        out = Path(out_dir)
        atomic_write_json(out / "eval.json", report)
        atomic_write_text(out / "eval.md", report.markdown())
    return report
