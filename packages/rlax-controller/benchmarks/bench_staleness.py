"""Steps per hour of the demo with bounded staleness (j, k) = (4, 8) against synchronous
(1, 1), measured side by side in the same session on the same machine.

Each setting is one `rlax launch` of the demo shape (shortened); the rate counts trained
steps between the first and the last training record, so process start-up and JAX
compilation are left out. Printed: both rates and their ratio.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

from rlax_controller.metrics import latest_per_step, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[3]
STEPS = 30


def run_demo(out: pathlib.Path, cache: pathlib.Path, j: int, k: int) -> float:
    cmd = [
        sys.executable, "-m", "rlax_core.cli", "launch", str(ROOT / "configs" / "demo.yaml"),
        f"run.output_dir={out}", f"run.jax_cache_dir={cache}", f"run.steps={STEPS}",
        f"workers.j={j}", f"trainer.k={k}", f"controller.lookahead_steps={k}",
        "eval.num_prompts=0",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    train = latest_per_step(read_metrics(out / "metrics.jsonl", kind="train"))
    # Skip the first steps: they include the trainer's first compilation.
    first, last = train[2], train[-1]
    return 3600.0 * (last["step"] - first["step"]) / (last["time"] - first["time"])


def test_steps_per_hour_j4k8_vs_synchronous(benchmark: Any, tmp_path: pathlib.Path) -> None:
    cache = tmp_path / "jax_cache"
    rates: dict[str, float] = {}

    def both() -> None:
        rates["sync (1,1)"] = run_demo(tmp_path / "sync", cache, 1, 1)
        rates["async (4,8)"] = run_demo(tmp_path / "async", cache, 4, 8)

    benchmark.pedantic(both, rounds=1, iterations=1)
    ratio = rates["async (4,8)"] / rates["sync (1,1)"]
    print(
        f"\nsteps/hour: sync (1,1) {rates['sync (1,1)']:.0f}, async (4,8) {rates['async (4,8)']:.0f}, ratio {ratio:.2f}x"
    )
    benchmark.extra_info.update(rates | {"ratio": ratio})
    assert rates["sync (1,1)"] > 0 and rates["async (4,8)"] > 0
