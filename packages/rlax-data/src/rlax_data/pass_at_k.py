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

from rlax_data._io import atomic_write_json
from rlax_data.datasets import Record
from rlax_data.sampling import PromptRenderer, Sampler, check_samples, render_prompts
from rlax_data.verify.base import Verifier, VerifyResult
from rlax_protocol.atomic_files import atomic_write_bytes

__all__ = ["EvalReport", "avg_at_k", "evaluate", "extracted_answer", "maj_at_k", "pass_at_k"]


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
    """Mean correctness of k samples, estimated from all n samples of one prompt.

    The mean over k samples, averaged over every way to choose k of the n samples, is
    the mean of all n: each sample lies in the same number of the subsets. Using all n
    (rather than the first k) gives the same expectation with less variance.
    """
    if not 1 <= k <= len(correct):
        raise ValueError(f"avg_at_k: need 1 <= k <= {len(correct)}, got {k}")
    return float(np.mean(np.asarray(correct, dtype=np.float64)))


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
    """metrics[group][metric] for group "all" and each record `task`; per_prompt rows.

    maj@k appears only for groups whose every task extracts answers (see `evaluate`);
    elsewhere it is absent, not 0.
    """

    n: int
    ks: list[int]
    metrics: dict[str, dict[str, float]]
    counts: dict[str, int]
    per_prompt: list[dict[str, Any]]

    def markdown(self) -> str:
        names = [f"{m}@{k}" for m in ("pass", "avg", "maj") for k in self.ks]
        names = [name for name in names if any(name in m for m in self.metrics.values())]
        lines = ["| group | prompts | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
        for group, m in self.metrics.items():
            cells = " | ".join(f"{m[name]:.4f}" if name in m else "-" for name in names)
            lines.append(f"| {group} | {self.counts[group]} | {cells} |")
        return "\n".join(lines) + "\n"


def extracted_answer(completion: str, result: VerifyResult) -> str | None:
    """The answer the verifier extracted (`details["extracted"]`), or None.

    No fallback to the completion's text: voting on, say, the first line of a program
    ("```python") would count agreement where there is no answer.
    """
    got = result.details.get("extracted")
    return None if got is None else str(got)


def evaluate(
    records: Sequence[Record],
    sampler: Sampler,
    verifier: Verifier,
    *,
    n: int,
    ks: Sequence[int] = (1,),
    batch_size: int = 64,
    render: PromptRenderer | None = None,
    answer_of: Callable[[str, VerifyResult], str | None] = extracted_answer,
    out_dir: str | os.PathLike[str] | None = None,
) -> EvalReport:
    """Sample n completions per record, verify them, and compute pass@k, avg@k, maj@k
    for each k in `ks`, overall and per `record.task`. With `out_dir`, writes
    `eval.json` and `eval.md` there (atomically).

    maj@k is defined only for a task with an extracted answer to vote on: `answer_of`
    gives each sample's answer (default: the verifier's `details["extracted"]`), and a
    task whose samples never yield one (code, Countdown expressions) gets no maj@k,
    nor does a group holding such a task. Within a voting task, a prompt none of whose
    samples yields an answer scores maj@k = 0.
    """
    ks = sorted(set(ks))
    if not records:
        raise ValueError("records: nothing to evaluate")
    if not ks or ks[0] < 1 or ks[-1] > n:
        raise ValueError(f"ks: every k must be in [1, n={n}], got {ks}")
    per_prompt: list[dict[str, Any]] = []
    # Per prompt: each sample's extracted answer and correctness, for maj@k below.
    votes: list[tuple[list[str | None], list[bool]]] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        samples = sampler(render_prompts(chunk, render), n)
        check_samples(samples, len(chunk), n)
        items = [(s, r) for r, row in zip(chunk, samples) for s in row]
        results = verifier.verify(items)
        for j, record in enumerate(chunk):
            rs = results[j * n : (j + 1) * n]
            correct = [r.correct for r in rs]
            votes.append(([answer_of(s, r) for s, r in zip(samples[j], rs)], correct))
            row: dict[str, Any] = {"id": record.id, "task": record.task, "correct": sum(correct)}
            for k in ks:
                row[f"pass@{k}"] = pass_at_k(n, sum(correct), k)
                row[f"avg@{k}"] = avg_at_k(correct, k)
            per_prompt.append(row)
    # Whether a task has answers to vote on is known only once all its samples are in.
    voting_tasks = {
        row["task"] for row, (answers, _) in zip(per_prompt, votes) if any(a is not None for a in answers)
    }
    for row, (answers, correct) in zip(per_prompt, votes):
        if row["task"] in voting_tasks:
            for k in ks:
                row[f"maj@{k}"] = maj_at_k(answers, correct, k)
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in per_prompt:
        groups["all"].append(row)
        if row["task"]:
            groups[str(row["task"])].append(row)
    metric_names = [f"{m}@{k}" for m in ("pass", "avg", "maj") for k in ks]
    metrics = {
        g: {m: math.fsum(r[m] for r in rows) / len(rows) for m in metric_names if all(m in r for r in rows)}
        for g, rows in groups.items()
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
        atomic_write_bytes(out / "eval.md", report.markdown().encode("utf-8"))
    return report
