"""What the controller's benchmarks share: one `rlax launch` of a config as local processes,
its steady-state step rate, a figure's mean and range over seeds, and the JSON object
`RLAX_BENCH_JSON` names."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from rlax_controller.metrics import latest_per_step, read_metrics
from rlax_protocol.atomic_files import atomic_write_bytes


def launch(
    config: str | pathlib.Path,
    out: pathlib.Path,
    cache: pathlib.Path,
    overrides: Sequence[str],
    *,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """`rlax launch config` into `out`, compiled programs shared in `cache`; the run's
    training records, one per step (the latest where a step was logged twice)."""
    cmd = [
        sys.executable, "-m", "rlax_core.cli", "launch", str(config),
        f"run.output_dir={out}", f"run.jax_cache_dir={cache}", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=timeout_s)
    return latest_per_step(read_metrics(out / "metrics.jsonl", kind="train"))


def steady_steps_per_hour(train: list[dict[str, Any]]) -> tuple[float, float]:
    """(steps per hour, seconds) between the third and the last training record: the first
    steps hold the trainer's first compilation and are left out."""
    first, last = train[2], train[-1]
    seconds = last["time"] - first["time"]
    return 3600.0 * (last["step"] - first["step"]) / seconds, seconds


def mean_and_range(values: Sequence[float | None]) -> dict[str, float] | None:
    """Mean, min and max over seeds; None when a seed has no value (it never reached a target)."""
    if any(v is None for v in values):
        return None
    present = [float(v) for v in values if v is not None]
    return {"mean": statistics.fmean(present), "min": min(present), "max": max(present)}


def write_bench_json(figures: dict[str, Any]) -> None:
    """The benchmark's figures as one JSON object where `RLAX_BENCH_JSON` names a file."""
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        atomic_write_bytes(pathlib.Path(target), json.dumps(figures, indent=1).encode())
