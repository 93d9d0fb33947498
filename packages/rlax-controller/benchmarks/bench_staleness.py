"""Asynchrony, side by side in one session on one machine: time to the reward target, and
steps per hour.

`test_time_to_target` (issue 33): whole demo runs (`configs/demo.yaml`, its 300 steps and
evaluations, or `RLAX_BENCH_CONFIG`) per setting and seed, settings alternating within a
seed so a drift of the machine hits each. The target: the training reward's
`RLAX_BENCH_WINDOW`-step (20) moving average reaches `RLAX_BENCH_TARGET` (0.6), as
`tools/demo_lag_table.py` counts it. Per setting, mean and range over the seeds of: steps
to the target; wall seconds to it from the launch (start-up, SFT and compilation
included: what a user waits); RL seconds to it from the first training record; the end
point (eval pass@1 at the last step); steps per hour. `RLAX_BENCH_SETTINGS` picks settings
by name (default: sync, lag 2 tis, lag 2 tis partial), `RLAX_BENCH_SEEDS` (0,1,2) the seeds.
`RLAX_BENCH_JSON=FILE` writes `async_over_sync_time_to_target` (mean wall seconds to the
target, `lag 2 tis` over `sync`), `async_over_sync_rl_time_to_target`,
`partial_over_finish_throughput` (steps per hour, `lag 2 tis partial` over `lag 2 tis`,
when both ran) and every figure.

`test_steps_per_hour_by_lag`: steps per hour of the demo with pinned versions at lag 0,
1, 2 and 4 (k = lag, j = 1), and with the freshest-weights mode at (j, k) = (4, 8).

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
import statistics
import time
from typing import Any

import pytest
from launched_runs import launch, mean_and_range, steady_steps_per_hour, write_bench_json

from rlax_controller.metrics import read_metrics

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
    demo = ROOT / "configs" / "demo.yaml"
    train = launch(demo, out, cache, [f"run.steps={STEPS}", "eval.num_prompts=0", *overrides], timeout_s=1800)
    rate, _ = steady_steps_per_hour(train)
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


TIS = "trainer.objective.importance.correction={kind: tis, upper: 2.0}"
NO_CORRECTION = "trainer.objective.importance.correction={kind: none}"  # whatever the config sets


def lagged(lag: int, *extra: str) -> list[str]:
    return [f"controller.lag={lag}", f"trainer.k={lag}", f"paramserver.keep={max(4, lag + 1)}", *extra]


TIME_SETTINGS = {
    "sync": lagged(0, NO_CORRECTION),
    "lag 1": lagged(1, NO_CORRECTION),
    "lag 1 tis": lagged(1, TIS),
    "lag 2": lagged(2, NO_CORRECTION),
    "lag 2 tis": lagged(2, TIS),
    "lag 2 tis partial": lagged(2, TIS, "workers.on_new_version=interrupt"),
    # Before 2026-12-07 the default generated one batch ahead whatever the lag.
    "lag 2 tis ahead 1": lagged(2, TIS, "controller.lookahead_steps=1"),
    "lag 4": lagged(4, NO_CORRECTION),
    "lag 4 tis": lagged(4, TIS),
    "lag 4 tis partial": lagged(4, TIS, "workers.on_new_version=interrupt"),
}
CHOSEN = os.environ.get("RLAX_BENCH_SETTINGS", "sync,lag 2 tis,lag 2 tis partial").split(",")
SEEDS = [int(s) for s in os.environ.get("RLAX_BENCH_SEEDS", "0,1,2").split(",")]
RUN_TIMEOUT_S = 3600
TIME_CONFIG = os.environ.get("RLAX_BENCH_CONFIG", str(ROOT / "configs" / "demo.yaml"))


def steps_to_target(train: list[dict[str, Any]], target: float, window: int) -> dict[str, Any] | None:
    """The first training record at which the `window`-step moving average of the reward
    reaches `target`, or None."""
    rewards = [float(r["reward_mean"]) for r in train]
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1 : i + 1]) >= target:
            return train[i]
    return None


def run_to_target(out: pathlib.Path, cache: pathlib.Path, overrides: list[str]) -> dict[str, Any]:
    target = float(os.environ.get("RLAX_BENCH_TARGET", "0.6"))
    window = int(os.environ.get("RLAX_BENCH_WINDOW", "20"))
    launched = time.time()
    train = launch(TIME_CONFIG, out, cache, overrides, timeout_s=RUN_TIMEOUT_S)
    evals = read_metrics(out / "metrics.jsonl", kind="eval")
    reached = steps_to_target(train, target, window)
    return {
        "steps_to_target": reached["step"] if reached else None,
        "wall_seconds_to_target": reached["time"] - launched if reached else None,
        "rl_seconds_to_target": reached["time"] - train[0]["time"] if reached else None,
        "end_eval_pass_at_1": float([r for r in evals if r["step"] == train[-1]["step"]][-1]["pass@1"]),
        "steps_per_hour": steady_steps_per_hour(train)[0],
        "wall_seconds": time.time() - launched,
    }


@pytest.mark.timeout(RUN_TIMEOUT_S * len(CHOSEN) * len(SEEDS))
def test_time_to_target(benchmark: Any, tmp_path: pathlib.Path) -> None:
    unknown = [name for name in CHOSEN if name not in TIME_SETTINGS]
    assert not unknown, f"RLAX_BENCH_SETTINGS names {unknown}; known: {list(TIME_SETTINGS)}"
    cache = tmp_path / "jax_cache"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CHOSEN}
    # A few steps of each setting first, untimed: every timed run then finds its programs in
    # the shared compilation cache, so none of them pays the cold start the others skip.
    for i, name in enumerate(CHOSEN):
        out = tmp_path / f"warmup{i}"
        launch(
            TIME_CONFIG,
            out,
            cache,
            [*TIME_SETTINGS[name], "run.steps=4", "eval.every=4"],
            timeout_s=RUN_TIMEOUT_S,
        )

    def every_run() -> None:
        for seed in SEEDS:
            for i, name in enumerate(CHOSEN):
                out = tmp_path / f"setting{i}-seed{seed}"
                runs[name].append(run_to_target(out, cache, [f"run.seed={seed}", *TIME_SETTINGS[name]]))
                print(f"{name} seed {seed}: {runs[name][-1]}", flush=True)

    benchmark.pedantic(every_run, rounds=1, iterations=1)
    keys = (
        "steps_to_target",
        "wall_seconds_to_target",
        "rl_seconds_to_target",
        "end_eval_pass_at_1",
        "steps_per_hour",
    )
    figures: dict[str, Any] = {"seeds": SEEDS, "runs": runs}
    print(f"\nseeds {SEEDS}: mean [min, max]; '-' where a seed did not reach the target")
    print(f"{'setting':>18} " + " ".join(f"{k:>26}" for k in keys))
    for name in CHOSEN:
        cells = []
        for key in keys:
            s = mean_and_range([r[key] for r in runs[name]])  # None: a seed missed the target
            figures[f"{name}|{key}"] = s
            cells.append(f"{s['mean']:9.3f} [{s['min']:.3f}, {s['max']:.3f}]" if s else "-")
        print(f"{name:>18} " + " ".join(f"{c:>26}" for c in cells))

    def ratio(numerator: str, denominator: str, key: str) -> float | None:
        a, b = figures.get(f"{numerator}|{key}"), figures.get(f"{denominator}|{key}")
        return a["mean"] / b["mean"] if a and b else None

    figures["async_over_sync_time_to_target"] = ratio("lag 2 tis", "sync", "wall_seconds_to_target")
    figures["async_over_sync_rl_time_to_target"] = ratio("lag 2 tis", "sync", "rl_seconds_to_target")
    figures["partial_over_finish_throughput"] = ratio("lag 2 tis partial", "lag 2 tis", "steps_per_hour")
    for key in (
        "async_over_sync_time_to_target",
        "async_over_sync_rl_time_to_target",
        "partial_over_finish_throughput",
    ):
        print(f"{key}: {figures[key]}")
    benchmark.extra_info.update({k: v for k, v in figures.items() if k != "runs"})
    write_bench_json(figures)
    assert all(r["steps_per_hour"] > 0 for rs in runs.values() for r in rs)
