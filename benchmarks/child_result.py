"""How the side processes of `bench_real_model.py` hand back their figures: one JSON file,
written under a temporary name and renamed, with the process's own peak RSS added."""

from __future__ import annotations

import json
import pathlib
import resource
from typing import Any


def write_result(out: pathlib.Path, name: str, result: dict[str, Any]) -> None:
    """`out/<name>.json` = result + {"peak_rss_mb": this process's peak resident set}."""
    record = {**result, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / f"{name}.json")
