"""TRL's GRPO update on the very sequences the RLAX run trained on: the TRL half of
`bench_real_model.py`'s same-sequences training comparison, in a process of its own.

    python benchmarks/real_model_trl_replay.py CONFIG.json

CONFIG.json: {"rlax_config": path, "overrides": [...], "hf_dir": path, "out": path, "steps": N,
"batches": path}. `batches` is the JSON `bench_real_model.py` exports from the RLAX run's
batch journal: per step, each rollout's prompt and completion token ids and its reward.

`GRPOTrainer.train()` runs as in `real_model_trl.py` (same `GRPOConfig`: float32, gradient
checkpointing as TRL defaults it, one optimizer step per batch of group_size rollouts, no
gradient accumulation), except that `_generate_and_score_completions` hands back the step's
journaled batch instead of sampling one: the inputs dict that method builds (prompts padded
left, completions right, advantages from the rewards by TRL's own rule). So the update --
`training_step` -> `compute_loss` -> backward, gradient clipping, AdamW -- is TRL's own code
on RLAX's token ids. Writes `out/trl_replay.json`: per step the update's seconds (step wall
minus building the inputs), the real tokens its forward pass saw and the loss.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any

from child_result import write_result
from real_model_trl import grpo_args


def trl_inputs(batch: dict[str, Any], pad_id: int, group_size: int) -> dict[str, Any]:
    """The dict `GRPOTrainer._generate_and_score_completions` returns, for one journaled batch.

    Mirrors that method for this job (one process, text only, no vLLM, num_iterations = 1 and
    steps_per_generation = gradient_accumulation_steps = 1, so no old log-probs: `_compute_loss`
    uses its own detached ones), with the padding helper and `nanstd` it uses."""
    import torch
    from trl.trainer.utils import nanstd, pad

    prompts = [torch.tensor(ids) for ids in batch["prompt_ids"]]
    completions = [torch.tensor(ids) for ids in batch["completion_ids"]]
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    # Advantages: multi_objective_aggregation "sum_then_normalize" with one reward function of
    # weight 1 and scale_rewards "group": (r - group mean) / (group std, Bessel-corrected + 1e-4).
    rewards = torch.tensor(batch["rewards"], dtype=torch.float32)
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    std = nanstd(grouped, dim=1).repeat_interleave(group_size)
    return {
        "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=pad_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": (rewards - mean) / (std + 1e-4),
        "num_items_in_batch": completion_mask.sum(),
    }


def main(spec_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlax_core.config import load_config

    spec = json.loads(pathlib.Path(spec_path).read_text())
    config = load_config(spec["rlax_config"], spec["overrides"])
    out = pathlib.Path(spec["out"])
    batches = json.loads(pathlib.Path(spec["batches"]).read_text())
    steps = len(batches)
    torch.manual_seed(config.run.seed)
    tok = AutoTokenizer.from_pretrained(spec["hf_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    group = config.data.group_size

    clock: dict[str, Any] = {"inputs": [], "step": [], "begin": 0.0}
    seen: list[dict[str, float]] = []  # per step: what the loss's forward pass was given

    class ReplayGRPO(GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            started = time.perf_counter()
            batch = batches[len(clock["inputs"])]
            if len(inputs) != len(batch["rewards"]):
                raise RuntimeError(
                    f"TRL asked for {len(inputs)} rollouts, the batch has {len(batch['rewards'])}"
                )
            result = trl_inputs(batch, tok.pad_token_id, group)
            clock["inputs"].append(time.perf_counter() - started)
            return result

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            loss = super()._compute_loss(model, inputs)
            seen.append(
                {
                    "tokens": float(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()),
                    "completion_tokens": float(inputs["completion_mask"].sum()),
                    "positions": float(inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()),
                    "loss": float(loss.detach()),
                }
            )
            return loss

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock["begin"] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock["step"].append(time.perf_counter() - clock["begin"])

    # The prompts' text is never read: generation is replaced by the journaled batches.
    rows = [{"prompt": [{"role": "user", "content": f"step {i}"}]} for i in range(steps)]
    trainer = ReplayGRPO(
        model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=grpo_args(config, out / "trl_replay", steps), train_dataset=Dataset.from_list(rows),
        processing_class=tok, callbacks=[StepClock()],
    )  # fmt: skip
    if trainer.accelerator.mixed_precision != "no" or model.dtype != torch.float32:
        raise RuntimeError(f"not float32: {trainer.accelerator.mixed_precision=}, {model.dtype=}")
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    if not (len(clock["step"]) == len(clock["inputs"]) == len(seen) == steps):
        raise RuntimeError(f"{steps} batches, {len(clock['step'])} steps, {len(seen)} loss passes")
    result = {
        "steps": [
            {"step": i + 1, "train_s": s - g, **n}
            for i, (s, g, n) in enumerate(zip(clock["step"], clock["inputs"], seen, strict=True))
        ],
        "wall_s": wall,
        "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
    }
    write_result(out, "trl_replay", result)


if __name__ == "__main__":
    main(sys.argv[1])
