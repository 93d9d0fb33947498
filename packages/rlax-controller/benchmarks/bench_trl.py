"""Time to the demo's reward target: RLAX against TRL's `GRPOTrainer`, same model, task,
prompts and machine, side by side.

1. One shortened `rlax launch` of the demo (SFT warm start, then GRPO, evaluation every
   `EVAL_EVERY` steps); it keeps every checkpoint so the post-SFT weights (version 0) stay.
2. `rlax convert to-hf --step 0` exports those weights; a `tokenizers` char-level
   tokenizer over `CharTokenizer`'s vocabulary (same ids) makes them usable by TRL.
3. TRL's `GRPOTrainer` trains the same weights on the same training prompts: the demo's
   prompts x samples per generation batch, its optimizer steps per batch
   (`steps_per_generation` = `trainer.minibatches`), the same lr and schedule (cosine down
   to `min_lr_ratio` over the run), clip (0.2), no KL, same max new tokens and temperature,
   reward from the same `rlax_data` verifier. A callback evaluates the same 64 held-out prompts x 8 samples at
   temperature 1 after the same number of batches.

Target: evaluation mean reward >= (post-SFT reward of the RLAX run) + `TARGET_GAIN`.
Seconds to target count from the end of the post-SFT evaluation to the end of the first
evaluation at or above the target, minus the time spent in evaluations, so both sides
are timed on RL training only (RLAX's includes its first JAX compilation).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from typing import Any

from rlax_controller.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[3]
STEPS = 160  # RL steps (generation batches) for both sides
EVAL_EVERY = 20
TARGET_GAIN = 0.15


def run_rlax(out: pathlib.Path, cache: pathlib.Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "rlax_core.cli", "launch", str(ROOT / "configs" / "demo.yaml"),
        f"run.output_dir={out}", f"run.jax_cache_dir={cache}", f"run.steps={STEPS}",
        f"eval.every={EVAL_EVERY}", f"trainer.checkpoint_keep={STEPS + 2}",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    evals: dict[int, dict[str, Any]] = {}
    for record in read_metrics(out / "metrics.jsonl", kind="eval"):
        evals.setdefault(int(record["step"]), record)  # the end-of-run repeat is dropped
    curve, eval_seconds = [], 0.0
    start = evals[0]["time"]
    for step in sorted(evals):
        record = evals[step]
        if step > 0:
            eval_seconds += record["seconds"]
        curve.append((step, float(record["reward_mean"]), record["time"] - start - eval_seconds))
    return {"curve": curve}


def hf_tokenizer(ctok: Any) -> Any:
    """`CharTokenizer`'s ids as a `PreTrainedTokenizerFast` (its `hf_backend`: one token per
    character, the same one `rlax convert to-hf` writes to tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=ctok.hf_backend(), bos_token=ctok.BOS, eos_token=ctok.EOS, pad_token=ctok.PAD
    )
    tok.padding_side = "left"
    return tok


def run_trl(config_path: pathlib.Path, hf_dir: pathlib.Path, out: pathlib.Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlax_core.config import load_config
    from rlax_data.run_task import build_task

    torch.manual_seed(0)
    config = load_config(config_path, [])
    prompts_per_step, group = config.data.prompts_per_step, config.data.group_size
    minibatches = config.trainer.minibatches
    schedule: dict[str, Any] = (
        {"lr_scheduler_type": "cosine_with_min_lr",
         "lr_scheduler_kwargs": {"min_lr_rate": config.trainer.min_lr_ratio}}
        if config.trainer.lr_schedule == "cosine"
        else {"lr_scheduler_type": "constant"}
    )  # fmt: skip
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
    for _ in range(STEPS * prompts_per_step):
        item = source.next_prompt()
        records[item.record.id] = item.record
        rows.append({"prompt": ctok.BOS + item.record.prompt_text(), "record_id": item.record.id})
    eval_records = task.eval_records()
    verifier = task.verifier

    def reward(completions: list[str], record_id: list[str], **_: Any) -> list[float]:
        results = verifier.verify([(c, records[r]) for c, r in zip(completions, record_id, strict=True)])
        return [float(r.reward) for r in results]

    def evaluate() -> float:
        enc = tok([ctok.BOS + r.prompt_text() for r in eval_records], add_special_tokens=False,
                  return_tensors="pt", padding=True)  # fmt: skip
        model.eval()
        with torch.no_grad():
            gen = model.generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=config.data.max_new_tokens, num_return_sequences=config.eval.n_samples,
            )  # fmt: skip
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        pairs = [(t, eval_records[i // config.eval.n_samples]) for i, t in enumerate(texts)]
        return sum(float(r.reward) for r in verifier.verify(pairs)) / len(pairs)

    curve: list[tuple[int, float, float]] = []
    clock = {"start": 0.0, "eval": 0.0}

    class Eval(TrainerCallback):
        def _record(self, step: int) -> None:
            t0 = time.perf_counter()
            value = evaluate()
            t1 = time.perf_counter()
            if step == 0:
                clock["start"] = t1
            else:
                clock["eval"] += t1 - t0
            curve.append((step, value, t1 - clock["start"] - clock["eval"]))

        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self._record(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if state.global_step % (EVAL_EVERY * minibatches) == 0:
                self._record(state.global_step // minibatches)

    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no", logging_steps=STEPS * minibatches,
        learning_rate=config.trainer.lr, **schedule, warmup_steps=0,
        max_grad_norm=config.trainer.max_grad_norm, weight_decay=0.0,
        num_generations=group,
        per_device_train_batch_size=prompts_per_step * group // minibatches, steps_per_generation=minibatches,
        gradient_accumulation_steps=1, max_steps=STEPS * minibatches, num_train_epochs=1,
        max_completion_length=config.data.max_new_tokens, temperature=config.data.temperature,
        top_k=0, beta=0.0, epsilon=0.2, loss_type="grpo", shuffle_dataset=False, seed=config.run.seed,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tok, callbacks=[Eval()],
    )  # fmt: skip
    trainer.train()
    return {"curve": curve}


def test_time_to_reward_target_vs_trl(benchmark: Any, tmp_path: pathlib.Path) -> None:
    results: dict[str, dict[str, Any]] = {}

    def ours() -> None:
        results["rlax"] = run_rlax(tmp_path / "rlax", tmp_path / "jax_cache")

    benchmark.pedantic(ours, rounds=1, iterations=1)
    hf_dir = tmp_path / "hf"
    config_path = tmp_path / "rlax" / "config.yaml"
    subprocess.run(
        [sys.executable, "-m", "rlax_core.cli", "convert", "to-hf", "--config", str(config_path),
         "--out", str(hf_dir), "--step", "0"],
        check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600,
    )  # fmt: skip
    results["trl"] = run_trl(config_path, hf_dir, tmp_path / "trl")

    start = results["rlax"]["curve"][0][1]
    target = start + TARGET_GAIN
    print(f"\ntarget: eval mean reward >= {target:.3f} (RLAX post-SFT {start:.3f} + {TARGET_GAIN})")
    print(f"{'step':>5} | {'RLAX reward':>11} {'RL s':>6} | {'TRL reward':>10} {'RL s':>6}")
    for (step, r1, t1), (_, r2, t2) in zip(results["rlax"]["curve"], results["trl"]["curve"], strict=False):
        print(f"{step:>5} | {r1:>11.3f} {t1:>6.1f} | {r2:>10.3f} {t2:>6.1f}")
    summary: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        step, _, last = r["curve"][-1]
        hit = next(((s, t) for s, v, t in r["curve"] if v >= target), None)
        summary[name] = {
            "seconds_to_target": None if hit is None else hit[1],
            "steps_to_target": None if hit is None else hit[0],
            "best_reward": max(v for _, v, _ in r["curve"]),
            "rl_seconds_per_step": last / step,
        }
        reached = (
            f"{hit[1]:.1f} s / {hit[0]} steps to target" if hit else f"target not reached in {STEPS} steps"
        )
        print(f"{name}: {reached}, best {summary[name]['best_reward']:.3f}, {last / step:.3f} RL s/step")
    if all(v["seconds_to_target"] is not None for v in summary.values()):
        ratio = summary["trl"]["seconds_to_target"] / summary["rlax"]["seconds_to_target"]
        print(f"seconds to target, TRL / RLAX: {ratio:.2f}x")
        summary["ratio_trl_over_rlax"] = {"seconds_to_target": ratio}
    benchmark.extra_info.update(
        {"target": target, **summary, "curves": {k: v["curve"] for k, v in results.items()}}
    )
    assert len(results["trl"]["curve"]) >= 2 and len(results["rlax"]["curve"]) >= 2
