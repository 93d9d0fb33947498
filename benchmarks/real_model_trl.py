"""TRL's `GRPOTrainer` side of `bench_real_model.py`, run in a process of its own.

    python benchmarks/real_model_trl.py CONFIG.json

CONFIG.json: {"rlax_config": path, "overrides": [...], "hf_dir": path, "out": path,
"steps": N, optional "lora": {"rank", "alpha", "targets"} (a peft LoRA; `--lora`),
optional "name" (the result file's name, default "trl")}. Trains the HF export of the run's initial weights on the run's prompts (in
stream order), with the run's verifier as the reward, one generation batch of one prompt
x group_size completions per optimizer step, and writes `out/trl.json`: per step the
seconds (generation, scoring and old log-probs vs the rest), the mean reward, and this
process's peak RSS.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any

from child_result import write_result


def grpo_args(config: Any, output_dir: pathlib.Path, steps: int) -> Any:
    """The `GRPOConfig` of the job (shared with `real_model_trl_replay.py`): the run's optimiser
    and sampling, one generation batch of one prompt x group_size completions per optimizer
    step. `bf16=False`: TRL's default (`bf16=True`, even with `use_cpu`) would run the forward
    passes under bfloat16 autocast, and both sides of this benchmark are float32."""
    from trl import GRPOConfig

    group = config.data.group_size
    return GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=steps,
        learning_rate=config.trainer.optimizer.lr, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=config.trainer.optimizer.max_grad_norm, weight_decay=config.trainer.optimizer.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        num_generations=group, per_device_train_batch_size=config.data.prompts_per_step * group,
        steps_per_generation=1, gradient_accumulation_steps=1, max_steps=steps, num_train_epochs=1,
        max_completion_length=config.data.max_new_tokens, temperature=config.data.temperature,
        top_p=config.data.top_p, top_k=config.data.top_k, beta=0.0, epsilon=0.2, loss_type="grpo",
        shuffle_dataset=False, seed=config.run.seed, disable_tqdm=True,
    )  # fmt: skip


def main(spec_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlax_core.config import load_config
    from rlax_data.task_from_config import build_task

    spec = json.loads(pathlib.Path(spec_path).read_text())
    config = load_config(spec["rlax_config"], spec["overrides"])
    steps, out = int(spec["steps"]), pathlib.Path(spec["out"])
    torch.manual_seed(config.run.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    task = build_task(config)
    tok = AutoTokenizer.from_pretrained(spec["hf_dir"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)

    source = task.prompt_source()
    records: dict[str, Any] = {}
    rows = []
    for _ in range(steps * config.data.prompts_per_step):
        item = source.next_prompt()
        records[item.record.id] = item.record
        rows.append(
            {"prompt": [{"role": "user", "content": item.record.prompt_text()}], "record_id": item.record.id}
        )
    first = records[rows[0]["record_id"]]
    theirs = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs  # a BatchEncoding in transformers 5
    ours = task.encode_prompt(first)
    assert list(theirs) == list(ours), f"TRL's prompt ids {theirs} != RLAX's {ours}"

    rewards: list[float] = []
    tokens: list[tuple[int, int]] = []  # per step: (prompt, completion) tokens of the batch, no padding

    def reward(completions: list[Any], record_id: list[str], **kwargs: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        results = task.verifier.verify([(t, records[r]) for t, r in zip(texts, record_id, strict=True)])
        values = [float(r.reward) for r in results]
        rewards.append(sum(values) / len(values))
        prompts = sum(len(task.encode_prompt(records[r])) for r in record_id)
        tokens.append((prompts, sum(len(ids) for ids in kwargs["completion_ids"])))
        return values

    clock: dict[str, Any] = {"generation": [], "step": [], "begin": 0.0}

    class TimedGRPO(GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = super()._generate_and_score_completions(*args, **kwargs)
            clock["generation"].append(time.perf_counter() - started)
            return result

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock["begin"] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock["step"].append(time.perf_counter() - clock["begin"])

    args = grpo_args(config, out / "trl", steps)
    peft_config = None
    if spec.get("lora"):  # `bench_real_model.py --lora`: a peft LoRA of the RLAX run's rank and targets
        from peft import LoraConfig as PeftLoraConfig

        lora = spec["lora"]
        peft_config = PeftLoraConfig(
            r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["targets"], lora_dropout=0.0,
            bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip
    trainer = TimedGRPO(
        model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tok, callbacks=[StepClock()], peft_config=peft_config,
    )  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    result = {
        "steps": [
            {
                "step": i + 1,
                "seconds": s,
                "generation_s": g,
                "train_s": s - g,
                "reward_mean": r,
                "prompt_tokens": n[0],
                "tokens": n[0] + n[1],
            }  # fmt: skip
            for i, (s, g, r, n) in enumerate(
                zip(clock["step"], clock["generation"], rewards, tokens, strict=False)
            )
        ],
        "wall_s": wall,
    }
    write_result(out, spec.get("name", "trl"), result)


if __name__ == "__main__":
    main(sys.argv[1])
