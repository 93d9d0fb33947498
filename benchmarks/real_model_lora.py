"""`bench_real_model.py --lora`: SmolLM2-135M GRPO with LoRA, RLAX against TRL + peft and
against RLAX full-parameter, side by side in one benchmark run.

The job is the full-parameter table's (same prompts, samples, lengths, reward; float32), with
adapters of `rlax_core.config.LoraConfig`'s default rank and targets on both LoRA sides and the
learning rate 10x the full-parameter one (the published rule for LoRA in RL). Three runs, one
after the other: RLAX full-parameter (`rlax launch`), RLAX LoRA (`trainer.lora`), and TRL's
`GRPOTrainer` with a `peft` LoRA of the same rank, alpha and target modules
(`real_model_trl.py` with `lora`). Then `bench_lora_sync.py` measures bytes per version and a
worker's switch on the same model. Reported per side: the trainer's peak RSS (RLAX: the
trainer process; TRL: its one process, which also generates), median seconds per step
(generation and training apart), and the reward curve.

RLAX_BENCH_JSON keys: lora_trainer_peak_rss_mb, full_trainer_peak_rss_mb,
trl_peft_trainer_peak_rss_mb, lora_step_seconds, full_step_seconds, trl_peft_step_seconds,
lora_push_bytes, full_push_bytes, lora_switch_seconds, full_switch_seconds, and the ratios
lora_over_full_trainer_rss, lora_over_trl_peft_trainer_rss, lora_over_trl_peft_step_seconds.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
SYNC_BENCH = ROOT / "packages" / "rlax-inference" / "benchmarks" / "bench_lora_sync.py"
LR_FACTOR = 10.0


def lora_overrides(base_lr: float) -> tuple[list[str], dict[str, Any]]:
    """The RLAX overrides of the LoRA side and the peft settings of the same adapters."""
    from rlax_core.config import LoraConfig

    lora = LoraConfig()
    lr = base_lr * LR_FACTOR
    rlax = [
        f"trainer.lora.rank={lora.rank}",
        f"trainer.lora.alpha={lora.alpha}",
        f"trainer.optimizer.lr={lr}",
        "trainer.sft_steps=0",
    ]
    peft = {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.target_names())}
    return rlax, peft


def run_lora(
    out: pathlib.Path,
    steps: int,
    *,
    base_lr: float,
    run_rlax: Callable[..., dict[str, Any]],
    run_child: Callable[..., dict[str, Any]],
    export_hf: Callable[[pathlib.Path], pathlib.Path],
    env: dict[str, str],
) -> dict[str, Any]:
    rlax_lora, peft = lora_overrides(base_lr)
    results: dict[str, Any] = {"lora": peft, "lr": base_lr * LR_FACTOR}
    results["rlax_full"] = run_rlax(out, steps, name="rlax_full")
    results["rlax_lora"] = run_rlax(out, steps, name="rlax_lora", extra=rlax_lora)
    hf_dir = str(export_hf(out))
    results["trl_peft"] = run_child(
        "real_model_trl", out, steps, more_overrides=[f"trainer.optimizer.lr={base_lr * LR_FACTOR}"],
        hf_dir=hf_dir, lora=peft, name="trl_peft",
    )  # fmt: skip
    target = out / "lora_sync.json"
    subprocess.run(
        [sys.executable, str(SYNC_BENCH)],
        env={**env, "RLAX_BENCH_JSON": str(target)},
        check=True,
        timeout=3600,
    )
    results["sync"] = json.loads(target.read_text())
    return results


def _median(rows: list[dict[str, Any]], key: str, skip: int) -> float:
    return statistics.median(r[key] for r in rows[skip:])


def report_lora(results: dict[str, Any], warm_steps: int) -> tuple[str, dict[str, float]]:
    """The side-by-side table (text) and the headline figures."""
    full, lora, trl = results["rlax_full"], results["rlax_lora"], results["trl_peft"]
    sync = results["sync"]
    half = len(lora["steps"]) // 2

    def curve(rows: list[dict[str, Any]]) -> str:
        first = statistics.mean(r["reward_mean"] for r in rows[:half])
        last = statistics.mean(r["reward_mean"] for r in rows[half:])
        return f"{first:.3f} -> {last:.3f}"

    figures = {
        "lora_trainer_peak_rss_mb": lora["peak_rss_mb"].get("trainer", float("nan")),
        "full_trainer_peak_rss_mb": full["peak_rss_mb"].get("trainer", float("nan")),
        "trl_peft_trainer_peak_rss_mb": trl["peak_rss_mb"],
        "lora_step_seconds": _median(lora["steps"], "seconds", warm_steps),
        "full_step_seconds": _median(full["steps"], "seconds", warm_steps),
        "trl_peft_step_seconds": _median(trl["steps"], "seconds", warm_steps),
        "lora_train_seconds": _median(lora["steps"], "train_s", warm_steps),
        "full_train_seconds": _median(full["steps"], "train_s", warm_steps),
        "trl_peft_train_seconds": _median(trl["steps"], "train_s", warm_steps),
        "lora_push_bytes": sync["lora_push_bytes"],
        "full_push_bytes": sync["full_push_bytes"],
        "lora_switch_seconds": sync["lora_unmerged_switch_seconds"],  # the default, workers.lora_apply
        "lora_merged_switch_seconds": sync["lora_switch_seconds"],
        "full_switch_seconds": sync["full_switch_seconds"],
    }
    figures["lora_over_full_trainer_rss"] = (
        figures["lora_trainer_peak_rss_mb"] / figures["full_trainer_peak_rss_mb"]
    )
    figures["lora_over_trl_peft_trainer_rss"] = (
        figures["lora_trainer_peak_rss_mb"] / figures["trl_peft_trainer_peak_rss_mb"]
    )
    figures["lora_over_trl_peft_step_seconds"] = (
        figures["lora_step_seconds"] / figures["trl_peft_step_seconds"]
    )
    figures["push_bytes_ratio"] = figures["lora_push_bytes"] / figures["full_push_bytes"]
    figures["switch_seconds_ratio"] = figures["lora_switch_seconds"] / figures["full_switch_seconds"]
    lines = [
        f"SmolLM2-135M GRPO, LoRA rank {results['lora']['rank']} (alpha {results['lora']['alpha']}) on "
        f"{', '.join(results['lora']['targets'])}, lr {results['lr']:g}; medians after {warm_steps} steps",
        f"{'':28s} {'RLAX full':>12s} {'RLAX LoRA':>12s} {'TRL + peft':>12s}",
        f"{'trainer peak RSS (MiB)':28s} {figures['full_trainer_peak_rss_mb']:12.0f} "
        f"{figures['lora_trainer_peak_rss_mb']:12.0f} {figures['trl_peft_trainer_peak_rss_mb']:12.0f}",
        f"{'seconds per step':28s} {figures['full_step_seconds']:12.2f} {figures['lora_step_seconds']:12.2f} "
        f"{figures['trl_peft_step_seconds']:12.2f}",
        f"{'  of which training':28s} {figures['full_train_seconds']:12.2f} {figures['lora_train_seconds']:12.2f} "
        f"{figures['trl_peft_train_seconds']:12.2f}",
        f"{'reward, first -> second half':28s} {curve(full['steps']):>12s} {curve(lora['steps']):>12s} "
        f"{curve(trl['steps']):>12s}",
        f"LoRA trainer RSS = {figures['lora_over_full_trainer_rss']:.2f}x RLAX full, "
        f"{figures['lora_over_trl_peft_trainer_rss']:.2f}x TRL + peft's process (which also generates); "
        f"step = {figures['lora_over_trl_peft_step_seconds']:.2f}x TRL + peft's",
        f"bytes per version {figures['lora_push_bytes'] / 1e6:.1f} MB vs {figures['full_push_bytes'] / 1e6:.1f} MB "
        f"({figures['push_bytes_ratio']:.4f}x); a worker's switch {figures['lora_switch_seconds']:.3f} s vs "
        f"{figures['full_switch_seconds']:.3f} s ({figures['switch_seconds_ratio']:.3f}x)",
    ]
    return "\n".join(lines), figures


def write_json(figures: dict[str, float]) -> None:
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        from rlax_protocol.atomic_files import atomic_write_bytes

        atomic_write_bytes(pathlib.Path(target), json.dumps(figures, indent=1).encode())
