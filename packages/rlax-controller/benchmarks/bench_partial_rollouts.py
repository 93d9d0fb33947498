"""Partial rollouts against finishing every sample on its old weights, side by side on the
long-tail setting (`configs/long-tail-demo.yaml`: digit sorting with Pareto-tailed lengths,
lag 2, k 2, TIS), the same seeds for both, in one session on one machine.

Each setting is one `rlax launch` per seed (all components as local processes), `finish`
(`workers.on_new_version: finish`, whole groups) and `interrupt` (partial rollouts, segments
of max_new_tokens / lag tokens). Reported per setting as mean and range over the seeds:
- throughput: trained steps per hour between the third and the last training record
  (start-up and the first compilation left out), and generated tokens per second over the
  same records;
- the end point: eval pass@1 at the last step (eval runs at the end only);
- for `interrupt`, the share of a batch's tokens that newer weights drew.

`RLAX_BENCH_SEEDS` (default 0,1,2) and `RLAX_BENCH_STEPS` (default 40) shorten or widen it;
`RLAX_BENCH_MODES` picks modes (default finish,interrupt; `interrupt_keep` adds partial
rollouts that keep their stale K/V, `workers.resume_kv: keep`, and the keys
`kept_kv_over_recomputed_throughput` and `kept_kv_partial_over_finish_throughput`);
`RLAX_BENCH_CONFIG` names another config file (default the long-tail setting);
`RLAX_BENCH_OVERRIDES` (space-separated key=value) change both modes' config, e.g.
"controller.lag=3 trainer.k=3 workers.segment_newest_lag=2" (the last segment beside a
training step instead of on the critical path).
`RLAX_BENCH_JSON=FILE` writes one JSON object: `partial_over_finish_throughput` (mean steps
per hour, interrupt over finish), `partial_over_finish_tokens_per_s`, the end points'
means and ranges, and every seed's figures.

    RLAX_BENCH_JSON=out.json nox -s bench -- packages/rlax-controller/benchmarks/bench_partial_rollouts.py
"""

from __future__ import annotations

import os
import pathlib
import statistics
from typing import Any

import pytest
from launched_runs import launch, mean_and_range, steady_steps_per_hour, write_bench_json

from rlax_controller.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[3]
CONFIG = pathlib.Path(os.environ.get("RLAX_BENCH_CONFIG", ROOT / "configs" / "long-tail-demo.yaml"))
SEEDS = [int(s) for s in os.environ.get("RLAX_BENCH_SEEDS", "0,1,2").split(",")]
STEPS = int(os.environ.get("RLAX_BENCH_STEPS", "40"))
OVERRIDES = os.environ.get("RLAX_BENCH_OVERRIDES", "").split()
RUN_TIMEOUT_S = 3600
ALL_MODES = {
    "finish": ["workers.on_new_version=finish"],
    "interrupt": ["workers.on_new_version=interrupt"],
    # PipelineRL's choice: a resumed sample continues from its stale K/V where its worker has them.
    "interrupt_keep": ["workers.on_new_version=interrupt", "workers.resume_kv=keep"],
}
MODES = {m: ALL_MODES[m] for m in os.environ.get("RLAX_BENCH_MODES", "finish,interrupt").split(",")}


def run_once(out: pathlib.Path, cache: pathlib.Path, steps: int, seed: int, mode: str) -> dict[str, float]:
    overrides = [f"run.steps={steps}", f"run.seed={seed}", f"eval.every={steps}", *OVERRIDES, *MODES[mode]]
    train = launch(CONFIG, out, cache, overrides, timeout_s=RUN_TIMEOUT_S)
    steps_per_hour, seconds = steady_steps_per_hour(train)
    tokens = sum(sum(r["response_tokens"]) for r in train[3:])
    final = [r for r in read_metrics(out / "metrics.jsonl", kind="eval") if r["step"] == steps]
    return {
        "steps_per_hour": steps_per_hour,
        "tokens_per_s": tokens / seconds,
        "eval_pass_at_1": float(final[-1]["pass@1"]),
        "newer_version_token_fraction": statistics.fmean(
            r.get("newer_version_token_fraction", 0.0) for r in train[3:]
        ),
    }


# Every launch has its own limit; the whole benchmark may take all of theirs.
@pytest.mark.timeout(RUN_TIMEOUT_S * len(MODES) * len(SEEDS))
def test_partial_rollouts_against_finishing_on_old_weights(benchmark: Any, tmp_path: pathlib.Path) -> None:
    seeds, steps = SEEDS, STEPS
    cache = tmp_path / "jax_cache"
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}

    def every_run() -> None:
        for seed in seeds:  # the two modes alternate, so a drift of the machine hits both
            for mode in MODES:
                results[mode].append(run_once(tmp_path / f"{mode}-{seed}", cache, steps, seed, mode))

    benchmark.pedantic(every_run, rounds=1, iterations=1)
    figures: dict[str, Any] = {"seeds": seeds, "steps": steps, "overrides": OVERRIDES, "per_seed": results}
    print(f"\nlong-tail setting {OVERRIDES}, {steps} steps, seeds {seeds} (mean, range)")
    for key in ("steps_per_hour", "tokens_per_s", "eval_pass_at_1", "newer_version_token_fraction"):
        for mode in MODES:
            s = mean_and_range([r[key] for r in results[mode]])
            assert s is not None  # every run has every figure
            figures[f"{mode}_{key}"] = s
            print(f"{mode:>10} {key:>30} {s['mean']:10.3f}  [{s['min']:.3f}, {s['max']:.3f}]")
    for mine, theirs, label in (
        ("interrupt", "finish", "partial_over_finish"),
        ("interrupt_keep", "finish", "kept_kv_partial_over_finish"),
        ("interrupt_keep", "interrupt", "kept_kv_over_recomputed"),
    ):
        if mine not in MODES or theirs not in MODES:
            continue
        for key, name in (("steps_per_hour", "throughput"), ("tokens_per_s", "tokens_per_s")):
            ratio = figures[f"{mine}_{key}"]["mean"] / figures[f"{theirs}_{key}"]["mean"]
            figures[f"{label}_{name}"] = ratio
            print(f"{mine} over {theirs}, {key}: {ratio:.2f}x")
    benchmark.extra_info.update({k: v for k, v in figures.items() if k != "per_seed"})
    write_bench_json(figures)
    assert all(r["steps_per_hour"] > 0 for runs in results.values() for r in runs)
