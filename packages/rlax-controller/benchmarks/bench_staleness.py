"""Steps per hour of the demo with pinned versions at lag 0, 1, 2 and 4 (k = lag, j = 1),
and with the freshest-weights mode at (j, k) = (4, 8), measured side by side in the same
session on the same machine.

Lag L lets the generation of step s (with version s - L) overlap the training of the L
steps before it: on a machine with spare cores that buys throughput; on 2 cores the
workers and the trainer share the CPU, so the gain is bounded by what is idle.

Each setting is one `rlax launch` of the demo shape (shortened, no evaluation); the rate
counts trained steps between the third and the last training record, so process start-up
and JAX compilation are left out. Printed per setting: steps/hour, seconds per step, the
trainer's peak resident memory, and the rate's ratio to lag 0.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

from rlax_controller.metrics import latest_per_step, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[3]
STEPS = 40
SETTINGS = {
    "lag 0": ["controller.lag=0", "trainer.k=0"],
    "lag 1": ["controller.lag=1", "trainer.k=1"],
    "lag 2": ["controller.lag=2", "trainer.k=2"],
    "lag 4": ["controller.lag=4", "trainer.k=4", "paramserver.keep=5"],  # keep >= lag + j
    "freshest (4,8)": ["controller.versions=freshest", "workers.j=4", "trainer.k=8"],
}


def run_demo(out: pathlib.Path, cache: pathlib.Path, overrides: list[str]) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "rlax_core.cli", "launch", str(ROOT / "configs" / "demo.yaml"),
        f"run.output_dir={out}", f"run.jax_cache_dir={cache}", f"run.steps={STEPS}",
        "eval.num_prompts=0", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    train = latest_per_step(read_metrics(out / "metrics.jsonl", kind="train"))
    # Skip the first steps: they include the trainer's first compilation.
    first, last = train[2], train[-1]
    rate = 3600.0 * (last["step"] - first["step"]) / (last["time"] - first["time"])
    peak = max((r.get("trainer_peak_rss_mb", 0.0) for r in train), default=0.0)
    return {"steps_per_hour": rate, "seconds_per_step": 3600.0 / rate, "trainer_peak_rss_mb": peak}


def test_steps_per_hour_by_lag(benchmark: Any, tmp_path: pathlib.Path) -> None:
    cache = tmp_path / "jax_cache"
    results: dict[str, dict[str, float]] = {}

    def every_setting() -> None:
        for i, (name, overrides) in enumerate(SETTINGS.items()):
            results[name] = run_demo(tmp_path / f"setting{i}", cache, overrides)

    benchmark.pedantic(every_setting, rounds=1, iterations=1)
    base = results["lag 0"]["steps_per_hour"]
    print(f"\n{'setting':>16} {'steps/hour':>11} {'s/step':>8} {'trainer RSS MB':>15} {'vs lag 0':>9}")
    for name, r in results.items():
        print(
            f"{name:>16} {r['steps_per_hour']:>11.0f} {r['seconds_per_step']:>8.3f}"
            f" {r['trainer_peak_rss_mb']:>15.0f} {r['steps_per_hour'] / base:>8.2f}x"
        )
    benchmark.extra_info.update({name: r for name, r in results.items()})
    assert all(r["steps_per_hour"] > 0 for r in results.values())
