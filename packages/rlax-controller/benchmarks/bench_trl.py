"""RLAX against TRL's `GRPOTrainer` on the demo (`configs/demo.yaml`): same model, task,
prompts, hyper-parameters and machine, over several seeds, side by side.

Per seed s (`RLAX_BENCH_SEEDS`):

1. One shortened `rlax launch` of the demo with `run.seed=s` (SFT warm start, then GRPO,
   evaluation every `RLAX_BENCH_EVAL_EVERY` steps); it keeps every checkpoint so that the
   post-SFT weights (version 0) stay.
2. `rlax convert to-hf --step 0` exports those weights; a `tokenizers` char-level
   tokenizer over `CharTokenizer`'s vocabulary (same ids) makes them usable by TRL.
3. TRL's `GRPOTrainer` (`seed=s`, `torch.manual_seed(s)`) trains the same weights.

What is matched: the post-SFT weights (per seed); the training prompts and their order
(RLAX's prompt stream, TRL's shuffle off); prompts x samples per generation batch; the
optimizer steps per batch (`steps_per_generation` = `trainer.minibatches`, rollouts
shuffled across the batch before the split: TRL's rule and RLAX's default
`trainer.minibatch_split: rows`); lr and schedule (cosine down to `min_lr_ratio` over the
run, no warm-up), grad-norm clip, no weight decay; clip 0.2, no KL (beta 0); per-sequence
token mean then mean over sequences (`loss_type: grpo`, RLAX's `sequence` aggregation);
max new tokens and temperature; the reward (the same `rlax_data` verifier); the evaluation
(the same held-out prompts x samples at temperature 1, after the same number of batches,
with a fixed sampling seed at every evaluation on both sides).

What differs: the advantage's std. RLAX's default is the population std (ddof 0) + eps
1e-6, TRL's the sample std (ddof 1) + eps 1e-4. `RLAX_BENCH_SEMANTICS=trl` runs RLAX with
TRL's rule, via command-line overrides `trainer.minibatch_split=rows
trainer.objective.advantage.ddof=1 trainer.objective.advantage.eps=1e-4` (the run config's
`trainer.objective` is merged key by key onto the preset; the written `config.yaml`, the
one the trainer reads, is checked to resolve to it). Also different by construction:
RLAX's components are separate processes (workers generate, the trainer trains, JAX
compiled; each seed's run starts with an empty JAX compilation cache so each one's RL
seconds include its first compilations, reported apart as `rlax_compile_seconds`); TRL
generates with `model.generate` in the trainer's process (PyTorch eager). The sampling
noise differs, so the curves agree only in distribution.

Recorded per run: the training reward of every RL step (RLAX: `reward_mean` of the `train`
records; TRL: the mean reward of each generation batch of prompts_per_step x group_size
completions, taken in the reward function, which TRL calls once per generation batch), the
evaluation reward at each evaluation step, and RL seconds at each one (from the end of the
post-SFT evaluation, minus the time spent in evaluations since). Caveat: during an RLAX
evaluation the workers also generate the next step's training groups (the evaluation's
requests go first), so subtracting its wall time also subtracts that overlapped generation,
which tilts RLAX's RL seconds slightly low; TRL evaluates strictly between steps.

Summaries per side over seeds (mean, sample std, min-max):
- reward AUC: mean training reward over steps 1..min(80, steps);
- evaluation reward at each evaluation step;
- steps and seconds to target, target = that seed's RLAX post-SFT evaluation reward +
  `TARGET_GAIN` (the same for both sides of a seed), at the first evaluation after step 0
  at or above it. A run that never reaches it is counted as not reached: the `_mean` uses
  reached runs only and `_reached` says how many; `_censored_mean` counts a run that did not
  reach it at its total RL seconds / steps (a lower bound);
- RL seconds per step: total RL seconds / steps.
Ratios: `trl_over_rlax_seconds_to_target` (of the reached-only means; `_censored` of the
censored means; `_paired` the mean per-seed ratio over seeds where both sides reached it)
and `rlax_over_trl_rl_seconds_per_step`. Nothing is asserted about performance: the test
checks only that every run produced a training reward per step and every evaluation.

Reproduce (the whole benchmark takes hours on a small CPU machine):

    RLAX_BENCH_JSON=out.json nox -s bench -- packages/rlax-controller/benchmarks/bench_trl.py

Environment: `RLAX_BENCH_SEEDS` (comma list, default `0,1,2,3`), `RLAX_BENCH_STEPS`
(default 160), `RLAX_BENCH_EVAL_EVERY` (default 20), `RLAX_BENCH_SEMANTICS` (`rlax`, the
default: RLAX's own defaults; `trl`: RLAX in TRL's semantics), `RLAX_BENCH_JSON` (a file to
write one JSON object with every figure to). A smoke run:

    RLAX_BENCH_SEEDS=0 RLAX_BENCH_STEPS=6 RLAX_BENCH_EVAL_EVERY=3 pytest -s \\
        -o python_files='bench_*.py' --benchmark-only packages/rlax-controller/benchmarks/bench_trl.py
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import pytest

from rlax_controller.metrics import format_number as fmt
from rlax_controller.metrics import latest_per_step, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.yaml"
TARGET_GAIN = 0.15
AUC_STEPS = 80  # reward AUC: mean training reward over steps 1..min(AUC_STEPS, steps)
TRL_SEMANTICS_OVERRIDES = [
    "trainer.minibatch_split=rows",
    "trainer.objective.advantage.ddof=1",
    "trainer.objective.advantage.eps=1e-4",
]
SIDES = ("rlax", "trl")
# The fields of RLAX's train records that break a step's wall time down (trainer_*_seconds,
# controller_*_seconds, worker_active_s, worker_reload_s, step_time_s).
STEP_PART_SUFFIXES = ("_seconds", "_active_s", "_reload_s", "step_time_s")
T0 = time.perf_counter()


@dataclass(frozen=True)
class Settings:
    seeds: list[int]
    steps: int
    eval_every: int
    semantics: str
    json_path: str

    @property
    def eval_steps(self) -> list[int]:
        """The steps both sides evaluate at: 0, every `eval_every`, and the last."""
        return sorted({0, *range(self.eval_every, self.steps + 1, self.eval_every), self.steps})

    @property
    def rlax_overrides(self) -> list[str]:
        return TRL_SEMANTICS_OVERRIDES if self.semantics == "trl" else []


def settings_from_env() -> Settings:
    seeds = [int(s) for s in os.environ.get("RLAX_BENCH_SEEDS", "0,1,2,3").split(",") if s.strip()]
    steps = int(os.environ.get("RLAX_BENCH_STEPS", "160"))
    eval_every = int(os.environ.get("RLAX_BENCH_EVAL_EVERY", "20"))
    semantics = os.environ.get("RLAX_BENCH_SEMANTICS", "rlax").strip().lower()
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"RLAX_BENCH_SEEDS: distinct seeds >= 0 needed, got {seeds}")
    if steps < 1 or eval_every < 1:
        raise ValueError(f"RLAX_BENCH_STEPS={steps}, RLAX_BENCH_EVAL_EVERY={eval_every}: both must be >= 1")
    if semantics not in ("rlax", "trl"):
        raise ValueError(f"RLAX_BENCH_SEMANTICS={semantics!r}: must be rlax or trl")
    return Settings(seeds, steps, eval_every, semantics, os.environ.get("RLAX_BENCH_JSON", ""))


def whole_run_timeout_s() -> float:
    """pytest-timeout's limit for the whole test (the project's default, 600 s, is one short
    run): each seed's RLAX launch limit, its export and as long again for TRL."""
    try:
        settings = settings_from_env()
    except ValueError:
        return 600.0  # the test itself reports the bad setting
    return len(settings.seeds) * (2 * rlax_timeout_s(settings.steps) + 600.0)


def progress(message: str) -> None:
    print(f"[bench_trl {time.perf_counter() - T0:7.0f} s] {message}", flush=True)


# ---------------------------------------------------------------------------- RLAX side
def rlax_semantics(config: Any) -> dict[str, Any]:
    """The update rule the trainer builds from a run config (`rlax trainer` builds its
    `LearnerConfig` with this same function from the run's written config.yaml)."""
    from rlax_trainer.trainer_process import learner_config

    learner = learner_config(config, mode="rl")
    objective = learner.objective
    advantage = objective.advantage
    return {
        "minibatch_split": learner.minibatch_split,
        "minibatches": learner.minibatches,
        "advantage": {
            "kind": advantage.kind,
            "ddof": getattr(advantage, "ddof", None),
            "eps": getattr(advantage, "eps", None),
        },
        "aggregation": objective.aggregation,
        "clip": [objective.importance.eps_low, objective.importance.eps_high],
        "kl_coef": objective.kl.coef,
    }


def rlax_timeout_s(steps: int) -> float:
    # Start-up and SFT (minutes on a small CPU machine), then generous per-step time.
    return 900.0 + 30.0 * steps


def stop_launch(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the launcher (it stops its components), then SIGKILL to its process group."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this benchmark started (start_new_session)
    except ProcessLookupError:
        pass
    proc.wait()


def run_rlax(
    settings: Settings, seed: int, out: pathlib.Path, cache: pathlib.Path, log_path: pathlib.Path
) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "rlax_core.cli", "launch", str(DEMO),
        f"run.output_dir={out}", f"run.jax_cache_dir={cache}", f"run.seed={seed}",
        f"run.steps={settings.steps}", f"eval.every={settings.eval_every}",
        f"trainer.checkpoint_keep={settings.steps + 2}", *settings.rlax_overrides,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    timeout = rlax_timeout_s(settings.steps)
    metrics_path = out / "metrics.jsonl"
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            seen_evals, last_note = -1, started
            while proc.poll() is None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                now = time.perf_counter()
                if now - started > timeout:
                    raise TimeoutError(f"rlax launch (seed {seed}) ran past {timeout:.0f} s; log: {log_path}")
                records = read_metrics(metrics_path)
                train = max((int(r["step"]) for r in records if r.get("kind") == "train"), default=0)
                evals = [r for r in records if r.get("kind") == "eval"]
                if len(evals) != seen_evals or now - last_note > 60:
                    last = f", eval@{evals[-1]['step']} {evals[-1]['reward_mean']:.3f}" if evals else ""
                    progress(f"seed {seed} rlax: step {train}/{settings.steps}{last} ({now - started:.0f} s)")
                    seen_evals, last_note = len(evals), now
        finally:
            stop_launch(proc)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(
            f"rlax launch (seed {seed}) exited {proc.returncode}; log {log_path}:\n" + "\n".join(tail)
        )

    evals: dict[int, dict[str, Any]] = {}
    for record in read_metrics(metrics_path, kind="eval"):
        evals.setdefault(int(record["step"]), record)  # the end-of-run repeat is dropped
    curve: list[list[float]] = []
    eval_seconds = 0.0
    start = evals[0]["time"]
    for step in sorted(evals):
        record = evals[step]
        if step > 0:
            eval_seconds += record["seconds"]
        curve.append([step, float(record["reward_mean"]), record["time"] - start - eval_seconds])
    train = latest_per_step(read_metrics(metrics_path, kind="train"))
    rewards = {int(r["step"]): float(r["reward_mean"]) for r in train}
    compile_s = sum(float(r.get("trainer_compile_seconds", 0.0)) for r in train)
    # A step's wall time (commit to commit, as the controller sees it) and its parts.
    parts = sorted({k for r in train for k in r if k.endswith(STEP_PART_SUFFIXES)})
    return {
        "step_seconds": [float(r["step_time_s"]) for r in train if "step_time_s" in r],
        "step_parts_median": {
            k: statistics.median(float(r[k]) for r in train if isinstance(r.get(k), int | float))
            for k in parts
        },
        "eval_curve": curve,
        "train_reward": [rewards.get(s) for s in range(1, settings.steps + 1)],
        "compile_seconds": compile_s,
        "wall_seconds": time.perf_counter() - started,
    }


def export_post_sft(config_path: pathlib.Path, hf_dir: pathlib.Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "rlax_core.cli", "convert", "to-hf", "--config", str(config_path),
         "--out", str(hf_dir), "--step", "0"],
        check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


# ----------------------------------------------------------------------------- TRL side
def hf_tokenizer(ctok: Any) -> Any:
    """`CharTokenizer`'s ids as a `PreTrainedTokenizerFast` (its `hf_backend`: one token per
    character, the same one `rlax convert to-hf` writes to tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=ctok.hf_backend(), bos_token=ctok.BOS, eos_token=ctok.EOS, pad_token=ctok.PAD
    )
    tok.padding_side = "left"
    return tok


def trl_args(config: Any, out: pathlib.Path, steps: int) -> Any:
    from trl import GRPOConfig

    prompts_per_step, group = config.data.prompts_per_step, config.data.group_size
    minibatches = config.trainer.minibatches
    schedule: dict[str, Any] = (
        {"lr_scheduler_type": "cosine_with_min_lr",
         "lr_scheduler_kwargs": {"min_lr_rate": config.trainer.optimizer.min_lr_ratio}}
        if config.trainer.optimizer.schedule == "cosine"
        else {"lr_scheduler_type": "constant"}
    )  # fmt: skip
    # bf16=False: GRPOConfig defaults to bf16=True, and with use_cpu the Trainer then runs
    # under bfloat16 autocast; RLAX trains the demo in float32, so TRL does too.
    return GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=steps * minibatches,
        learning_rate=config.trainer.optimizer.lr, **schedule, warmup_steps=0,
        max_grad_norm=config.trainer.optimizer.max_grad_norm, weight_decay=0.0,
        num_generations=group,
        per_device_train_batch_size=prompts_per_step * group // minibatches, steps_per_generation=minibatches,
        gradient_accumulation_steps=1, max_steps=steps * minibatches, num_train_epochs=1,
        max_completion_length=config.data.max_new_tokens, temperature=config.data.temperature,
        top_k=0, beta=0.0, epsilon=0.2, loss_type="grpo", shuffle_dataset=False, seed=config.run.seed,
        disable_tqdm=True,
    )  # fmt: skip


def trl_semantics(args: Any) -> dict[str, Any]:
    """TRL 1.x `GRPOTrainer`'s rule for these args: the generation batch is shuffled
    (`shuffle_sequence_dict`) then split into `steps_per_generation` minibatches; the group
    std is `nanstd` (Bessel-corrected: ddof 1) and the advantage divides by std + 1e-4."""
    return {
        "minibatch_split": "rows",
        "minibatches": args.steps_per_generation,
        "advantage": {"kind": "group_norm", "ddof": 1, "eps": 1e-4, "scale_rewards": args.scale_rewards},
        "aggregation": f"loss_type={args.loss_type}",
        "clip": [args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high],
        "kl_coef": args.beta,
    }


def run_trl(
    settings: Settings, seed: int, config_path: pathlib.Path, hf_dir: pathlib.Path, out: pathlib.Path
) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from rlax_core.config import load_config
    from rlax_data.task_from_config import build_task

    started = time.perf_counter()
    torch.manual_seed(seed)
    config = load_config(config_path, [])
    assert config.run.seed == seed, f"{config_path}: run.seed {config.run.seed} != {seed}"
    steps = settings.steps
    batch = config.data.prompts_per_step * config.data.group_size
    minibatches = config.trainer.minibatches
    task = build_task(config)
    ctok = task.tokenizer
    tok = hf_tokenizer(ctok)
    check = task.train_records()[0]
    ours = task.encode_prompt(check)
    theirs = tok(ctok.BOS + check.prompt_text(), add_special_tokens=False)["input_ids"]
    assert theirs == ours, f"HF tokenizer ids {theirs} != CharTokenizer ids {ours}"

    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.generation_config.eos_token_id = ctok.eos_id
    model.generation_config.pad_token_id = ctok.pad_id
    model.generation_config.bos_token_id = ctok.bos_id

    # Training prompts in RLAX's stream order; TRL's shuffle is off to keep that order.
    source = task.prompt_source()
    records: dict[str, Any] = {}
    rows = []
    for _ in range(steps * config.data.prompts_per_step):
        item = source.next_prompt()
        records[item.record.id] = item.record
        rows.append({"prompt": ctok.BOS + item.record.prompt_text(), "record_id": item.record.id})
    eval_records = task.eval_records()
    verifier = task.verifier
    train_reward: list[float] = []

    def reward(completions: list[str], record_id: list[str], **_: Any) -> list[float]:
        # TRL scores a whole generation batch (one RL step) in one call.
        if len(completions) != batch:
            raise RuntimeError(f"TRL scored {len(completions)} completions at once, expected {batch}")
        results = verifier.verify([(c, records[r]) for c, r in zip(completions, record_id, strict=True)])
        values = [float(r.reward) for r in results]
        train_reward.append(sum(values) / len(values))
        return values

    def evaluate() -> float:
        enc = tok([ctok.BOS + r.prompt_text() for r in eval_records], add_special_tokens=False,
                  return_tensors="pt", padding=True)  # fmt: skip
        model.eval()
        # A fixed sampling seed at every evaluation (RLAX's evaluation seeds are fixed too),
        # on a forked RNG so that evaluating leaves training's random stream unchanged.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(config.eval.seed)
            gen = model.generate(
                **enc, do_sample=True, temperature=config.eval.temperature, top_k=0, top_p=1.0,
                max_new_tokens=config.data.max_new_tokens, num_return_sequences=config.eval.n_samples,
            )  # fmt: skip
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        pairs = [(t, eval_records[i // config.eval.n_samples]) for i, t in enumerate(texts)]
        return sum(float(r.reward) for r in verifier.verify(pairs)) / len(pairs)

    curve: list[list[float]] = []
    clock = {"start": 0.0, "eval": 0.0}
    step_clock: list[float] = []  # at the end of each RL step: seconds, less evaluations so far
    eval_steps = set(settings.eval_steps)

    class Eval(TrainerCallback):
        def _record(self, step: int) -> None:
            t0 = time.perf_counter()
            value = evaluate()
            t1 = time.perf_counter()
            if step == 0:
                clock["start"] = t1
            else:
                clock["eval"] += t1 - t0
            curve.append([step, value, t1 - clock["start"] - clock["eval"]])
            progress(f"seed {seed} trl: step {step}/{steps}, eval@{step} {value:.3f} ({t1 - started:.0f} s)")

        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self._record(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if state.global_step % minibatches == 0:
                step_clock.append(time.perf_counter() - clock["eval"])
            if state.global_step % minibatches == 0 and state.global_step // minibatches in eval_steps:
                self._record(state.global_step // minibatches)

    args = trl_args(config, out, steps)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tok, callbacks=[Eval()],
    )  # fmt: skip
    trainer.train()
    padded: list[float | None] = [*train_reward[:steps], *[None] * (steps - len(train_reward))]
    return {
        "step_seconds": [b - a for a, b in zip(step_clock, step_clock[1:], strict=False)],
        "eval_curve": curve,
        "train_reward": padded,
        "reward_calls": len(train_reward),
        "wall_seconds": time.perf_counter() - started,
    }


# ------------------------------------------------------------------------------ summary
def stats(values: list[float | None]) -> dict[str, Any]:
    """mean, sample std (0 for one value), min, max and count of the values that are not None."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {
        "mean": statistics.fmean(present),
        "std": statistics.stdev(present) if len(present) > 1 else 0.0,
        "min": min(present),
        "max": max(present),
        "n": len(present),
    }


def run_figures(run: dict[str, Any], target: float, steps: int) -> dict[str, Any]:
    curve = run["eval_curve"]
    auc_rewards = run["train_reward"][: min(AUC_STEPS, steps)]
    total = curve[-1][2] if curve and curve[-1][0] == steps else None
    hit = next(((s, t) for s, v, t in curve if s > 0 and v >= target), None)
    return {
        "target": target,
        "post_sft_eval": curve[0][1] if curve else None,
        "final_eval": curve[-1][1] if curve else None,
        "reward_auc": None if None in auc_rewards else sum(auc_rewards) / len(auc_rewards),
        "reached": hit is not None,
        "steps_to_target": None if hit is None else hit[0],
        "seconds_to_target": None if hit is None else hit[1],
        "rl_seconds_total": total,
        "rl_seconds_per_step": None if total is None else total / steps,
    }


def fmt_stats(s: dict[str, Any], digits: int = 3) -> str:
    if s["mean"] is None:
        return "-"
    return (
        f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} "
        f"[{s['min']:.{digits}f}-{s['max']:.{digits}f}] (n={s['n']})"
    )


def summarise(
    settings: Settings, runs: dict[str, dict[int, dict[str, Any]]], semantics: Any
) -> dict[str, Any]:
    seeds, steps = settings.seeds, settings.steps
    targets = {s: runs["rlax"][s]["eval_curve"][0][1] + TARGET_GAIN for s in seeds}
    figures = {side: {s: run_figures(runs[side][s], targets[s], steps) for s in seeds} for side in SIDES}
    out: dict[str, Any] = {
        "seeds": seeds,
        "steps": steps,
        "eval_every": settings.eval_every,
        "eval_steps": settings.eval_steps,
        "semantics": settings.semantics,
        "semantics_rules": semantics,
        "rlax_overrides": settings.rlax_overrides,
        "target_gain": TARGET_GAIN,
        "auc_steps": min(AUC_STEPS, steps),
        "targets": [targets[s] for s in seeds],
        "std": "sample std over seeds (ddof 1; 0 for one seed)",
        "to_target_mean_rule": "reached runs only (see _reached); _censored_mean counts a run that "
        "did not reach the target at its total RL seconds / steps",
    }
    for side in SIDES:
        per = [figures[side][s] for s in seeds]
        for key in ("reward_auc", "steps_to_target", "seconds_to_target", "post_sft_eval", "final_eval"):
            summary = stats([f[key] for f in per])
            out[f"{side}_{key}_per_seed"] = [f[key] for f in per]
            for stat in ("mean", "std", "min", "max"):
                out[f"{side}_{key}_{stat}"] = summary[stat]
        spst = stats([f["rl_seconds_per_step"] for f in per])
        out[f"{side}_rl_seconds_per_step"] = spst["mean"]
        out[f"{side}_rl_seconds_per_step_std"] = spst["std"]
        out[f"{side}_rl_seconds_per_step_min"] = spst["min"]
        out[f"{side}_rl_seconds_per_step_max"] = spst["max"]
        out[f"{side}_rl_seconds_per_step_per_seed"] = [f["rl_seconds_per_step"] for f in per]
        out[f"{side}_rl_seconds_total_per_seed"] = [f["rl_seconds_total"] for f in per]
        reached = sum(f["reached"] for f in per)
        out[f"{side}_steps_to_target_reached"] = reached
        out[f"{side}_seconds_to_target_reached"] = reached
        for key, fallback in (("steps_to_target", lambda f: steps), ("seconds_to_target", None)):
            censored = [
                f[key] if f["reached"] else (fallback(f) if fallback else f["rl_seconds_total"]) for f in per
            ]
            out[f"{side}_{key}_censored_mean"] = stats(censored)["mean"]
        out[f"{side}_eval_reward"] = {
            str(step): stats(
                [next((v for s, v, _ in runs[side][seed]["eval_curve"] if s == step), None) for seed in seeds]
            )
            for step in settings.eval_steps
        }
        out[f"{side}_curves"] = {
            str(seed): {
                "eval": runs[side][seed]["eval_curve"],
                "train_reward": runs[side][seed]["train_reward"],
                "wall_seconds": runs[side][seed]["wall_seconds"],
            }
            for seed in seeds
        }
    out["rlax_compile_seconds_per_seed"] = [runs["rlax"][s]["compile_seconds"] for s in seeds]
    # The median step (evaluations and first compilations are outliers it leaves out): the
    # per-step cost without the eval-overlap caveat of the RL-seconds clock.
    for side in SIDES:
        medians = [
            statistics.median(runs[side][s]["step_seconds"]) for s in seeds if runs[side][s]["step_seconds"]
        ]
        out[f"{side}_step_seconds_median_per_seed"] = medians
        out[f"{side}_step_seconds_median"] = stats(medians)["mean"]
    out["rlax_step_parts_median"] = {
        k: stats([runs["rlax"][s]["step_parts_median"].get(k) for s in seeds])["mean"]
        for k in sorted({k for s in seeds for k in runs["rlax"][s]["step_parts_median"]})
    }

    def ratio(a: Any, b: Any) -> float | None:
        return a / b if a is not None and b else None

    out["trl_over_rlax_seconds_to_target"] = ratio(
        out["trl_seconds_to_target_mean"], out["rlax_seconds_to_target_mean"]
    )
    out["trl_over_rlax_seconds_to_target_censored"] = ratio(
        out["trl_seconds_to_target_censored_mean"], out["rlax_seconds_to_target_censored_mean"]
    )
    out["trl_over_rlax_seconds_to_target_per_seed"] = [
        ratio(figures["trl"][s]["seconds_to_target"], figures["rlax"][s]["seconds_to_target"]) for s in seeds
    ]
    # Seeds where both sides reached the target: the mean of their per-seed ratios.
    paired = [r for r in out["trl_over_rlax_seconds_to_target_per_seed"] if r is not None]
    out["trl_over_rlax_seconds_to_target_paired"] = statistics.fmean(paired) if paired else None
    out["trl_over_rlax_seconds_to_target_paired_n"] = len(paired)
    out["rlax_over_trl_rl_seconds_per_step"] = ratio(
        out["rlax_rl_seconds_per_step"], out["trl_rl_seconds_per_step"]
    )
    out["rlax_over_trl_step_seconds_median"] = ratio(
        out["rlax_step_seconds_median"], out["trl_step_seconds_median"]
    )
    out["rlax_minus_trl_reward_auc"] = (
        None
        if out["rlax_reward_auc_mean"] is None or out["trl_reward_auc_mean"] is None
        else out["rlax_reward_auc_mean"] - out["trl_reward_auc_mean"]
    )
    return out


def eval_cell(s: dict[str, Any]) -> str:
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:.3f} ± {s['std']:.3f} [{s['min']:.2f}-{s['max']:.2f}]"


def print_report(settings: Settings, summary: dict[str, Any]) -> None:
    seeds, steps = settings.seeds, settings.steps
    print(f"\nRLAX vs TRL on the demo: seeds {seeds}, {steps} steps, semantics={settings.semantics}")
    print(
        f"target per seed: RLAX post-SFT eval reward + {TARGET_GAIN}; "
        f"reward AUC: mean training reward over steps 1..{summary['auc_steps']}"
    )
    head = (
        f"{'seed':>4} {'side':>4} | {'post-SFT':>8} {'target':>6} {'AUC':>6} {'final':>6} | "
        f"{'steps→tgt':>9} {'s→tgt':>7} | {'RL s/step':>9}"
    )
    print(head)
    print("-" * len(head))
    for i, seed in enumerate(seeds):
        for side in SIDES:
            steps_hit = summary[f"{side}_steps_to_target_per_seed"][i]
            secs_hit = summary[f"{side}_seconds_to_target_per_seed"][i]
            print(
                f"{seed:>4} {side:>4} | {fmt(summary[f'{side}_post_sft_eval_per_seed'][i]):>8} "
                f"{fmt(summary['targets'][i]):>6} {fmt(summary[f'{side}_reward_auc_per_seed'][i]):>6} "
                f"{fmt(summary[f'{side}_final_eval_per_seed'][i]):>6} | "
                f"{(fmt(steps_hit) if steps_hit is not None else 'not'):>9} "
                f"{(fmt(secs_hit, 1) if secs_hit is not None else 'reached'):>7} | "
                f"{fmt(summary[f'{side}_rl_seconds_per_step_per_seed'][i]):>9}"
            )
    print("\nover seeds: mean ± sample std [min-max] (n)")
    for side in SIDES:
        print(f"  {side}:")
        for key, digits in (
            ("reward_auc", 3),
            ("final_eval", 3),
            ("steps_to_target", 1),
            ("seconds_to_target", 1),
        ):
            s = stats(summary[f"{side}_{key}_per_seed"])
            extra = ""
            if key.endswith("to_target"):
                extra = (
                    f"; reached {summary[f'{side}_{key}_reached']}/{len(seeds)}"
                    f", censored mean {fmt(summary[f'{side}_{key}_censored_mean'], 1)}"
                )
            print(f"    {key:<18} {fmt_stats(s, digits)}{extra}")
        s = stats(summary[f"{side}_rl_seconds_per_step_per_seed"])
        print(f"    {'rl_seconds/step':<18} {fmt_stats(s, 3)}")
    print(f"\n{'eval step':>9} | {'RLAX eval reward':>30} | {'TRL eval reward':>30}")
    for step in settings.eval_steps:
        r, t = summary["rlax_eval_reward"][str(step)], summary["trl_eval_reward"][str(step)]
        print(f"{step:>9} | {eval_cell(r):>30} | {eval_cell(t):>30}")
    print(
        f"\nseconds to target, TRL / RLAX (means of reached runs): "
        f"{fmt(summary['trl_over_rlax_seconds_to_target'], 2)}; "
        f"censored: {fmt(summary['trl_over_rlax_seconds_to_target_censored'], 2)}; "
        f"paired (mean per-seed ratio where both reached, n={summary['trl_over_rlax_seconds_to_target_paired_n']}): "
        f"{fmt(summary['trl_over_rlax_seconds_to_target_paired'], 2)}"
    )
    print(f"RL seconds per step, RLAX / TRL: {fmt(summary['rlax_over_trl_rl_seconds_per_step'], 2)}")
    print(
        f"median step seconds: RLAX {fmt(summary['rlax_step_seconds_median'])}, "
        f"TRL {fmt(summary['trl_step_seconds_median'])}, RLAX / TRL "
        f"{fmt(summary['rlax_over_trl_step_seconds_median'], 2)}"
    )
    print("RLAX's median step by part (seconds; mean over seeds of per-seed medians):")
    for key, value in summary["rlax_step_parts_median"].items():
        print(f"    {key:<34} {fmt(value, 4)}")
    print(
        f"RLAX compile seconds inside its RL time, per seed: {[round(x, 1) for x in summary['rlax_compile_seconds_per_seed']]}"
    )


def print_semantics(semantics: dict[str, Any], overrides: list[str]) -> None:
    print("\nupdate rules (minibatch split; advantage = (r - group mean) / (group std(ddof) + eps)):")
    for side in SIDES:
        rule = semantics[side]
        adv = rule["advantage"]
        print(
            f"  {side:>4}: minibatch_split={rule['minibatch_split']} x{rule['minibatches']}, "
            f"advantage {adv['kind']} ddof={adv['ddof']} eps={adv['eps']:g}, {rule['aggregation']}, "
            f"clip={rule['clip']}, kl={rule['kl_coef']}"
        )
    if overrides:
        print(f"  rlax overrides (RLAX_BENCH_SEMANTICS=trl): {' '.join(overrides)}")


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    target = pathlib.Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(json_safe(data), f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------- test
@pytest.mark.timeout(whole_run_timeout_s())
def test_rlax_vs_trl_grpo(benchmark: Any, tmp_path: pathlib.Path) -> None:
    from rlax_core.config import load_config

    settings = settings_from_env()
    expected = rlax_semantics(load_config(DEMO, settings.rlax_overrides))
    semantics = {
        "rlax": expected,
        "trl": trl_semantics(trl_args(load_config(DEMO, []), tmp_path / "trl_args", settings.steps)),
    }
    print_semantics(semantics, settings.rlax_overrides)
    runs: dict[str, dict[int, dict[str, Any]]] = {side: {} for side in SIDES}
    progress(
        f"seeds {settings.seeds}, {settings.steps} steps, eval every {settings.eval_every}, "
        f"semantics={settings.semantics}; RLAX launch timeout {rlax_timeout_s(settings.steps):.0f} s"
    )

    def every_seed() -> None:
        for seed in settings.seeds:
            out = tmp_path / f"rlax_seed{seed}"
            progress(f"seed {seed} rlax: launching")
            runs["rlax"][seed] = run_rlax(
                settings, seed, out, tmp_path / f"jax_cache_seed{seed}", tmp_path / f"rlax_seed{seed}.log"
            )
            progress(f"seed {seed} rlax: done in {runs['rlax'][seed]['wall_seconds']:.0f} s")
            # The trainer reads the written config.yaml: check that it resolves to the rule we mean.
            written = rlax_semantics(load_config(out / "config.yaml", []))
            if written != expected:
                raise RuntimeError(
                    f"seed {seed}: the run's config.yaml resolves to {written}, not {expected}"
                )
            adv = written["advantage"]
            progress(
                f"seed {seed} rlax: its config.yaml (what the trainer reads) resolves to "
                f"minibatch_split={written['minibatch_split']}, ddof={adv['ddof']}, eps={adv['eps']:g}"
            )
            hf_dir = tmp_path / f"hf_seed{seed}"
            export_post_sft(out / "config.yaml", hf_dir)
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # every step's weights: no longer needed
            progress(f"seed {seed} trl: training from the post-SFT weights")
            runs["trl"][seed] = run_trl(
                settings, seed, out / "config.yaml", hf_dir, tmp_path / f"trl_seed{seed}"
            )
            progress(f"seed {seed} trl: done in {runs['trl'][seed]['wall_seconds']:.0f} s")

    benchmark.pedantic(every_seed, rounds=1, iterations=1)

    summary = summarise(settings, runs, semantics)
    print_report(settings, summary)
    benchmark.extra_info.update(json_safe(summary))
    if settings.json_path:
        write_json(settings.json_path, summary)
        print(f"wrote {settings.json_path}")

    # Every run produced its curves: a training reward per step, an evaluation per eval step.
    for side in SIDES:
        for seed in settings.seeds:
            run = runs[side][seed]
            assert None not in run["train_reward"], f"{side} seed {seed}: missing training rewards"
            assert [int(s) for s, _, _ in run["eval_curve"]] == settings.eval_steps, (
                f"{side} seed {seed}: evaluations at {[s for s, _, _ in run['eval_curve']]}"
            )
