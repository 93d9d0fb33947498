"""TRL's GRPO update on the very sequences the RLAX run trained on: the TRL half of
`bench_real_model.py`'s same-sequences training comparison, in a process of its own.

    python benchmarks/real_model_trl_replay.py CONFIG.json

CONFIG.json: {"rlax_config": path, "overrides": [...], "hf_dir": path, "out": path, "steps": N,
"batches": path}. `batches` is the JSON `bench_real_model.py` exports from the RLAX run's
batch journal: per step, each rollout's prompt and completion token ids and its reward.

`GRPOTrainer.train()` runs as in `real_model_trl.py` (same `GRPOConfig`: float32, gradient
checkpointing as TRL defaults it, one optimizer step per batch of group_size rollouts, no
gradient accumulation), except that `_generate_and_score_completions` hands back the step's
journaled batch: the inputs dict that method builds (prompts padded left, completions right,
advantages from the rewards by TRL's own rule). So the update -- `training_step` ->
`compute_loss` -> backward, gradient clipping, AdamW -- is TRL's own code on RLAX's token ids.

Before that, the same method generates as TRL does (`_generate_single_turn`: its padding, its
`GenerationConfig`, `model.generate` with the KV cache) on the step's prompts, each sample
held to the length the journaled one has (`ForcedLengths`: no end token before it, the end
token as its last token); the completions are checked to have those lengths and then
dropped. A step's cost follows its samples' lengths, so this is TRL's generation on the run's
own work, and a step here (generation + update) is TRL's step on exactly the RLAX run's work.

Writes `out/trl_replay.json`: per step the whole step's seconds, the generation's seconds, the
update's seconds (the step minus generating and building the inputs), the real tokens its
forward pass saw, the loss, and this process's peak RSS so far.
"""

from __future__ import annotations

import functools
import json
import pathlib
import resource
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


def forced_lengths(lengths: list[int], ends: list[bool], eos_ids: list[int], max_new: int) -> Any:
    """A transformers `LogitsProcessor` under which row i of a `generate` call samples exactly
    lengths[i] tokens: its end tokens are masked out before that, and where the journaled
    sample ended with an end token (ends[i]) that token is forced as the last one. A sample
    that ended without one must have run to `max_new` (generation stops there)."""
    import torch
    from transformers import LogitsProcessor

    for n, ended in zip(lengths, ends, strict=True):
        if not ended and n != max_new:
            raise ValueError(f"a journaled sample of {n} tokens has no end token and is not {max_new} long")

    class ForcedLengths(LogitsProcessor):  # type: ignore[misc]
        def __init__(self) -> None:
            self.prompt_width: int | None = None
            self.target = torch.tensor(lengths)
            self.ends = torch.tensor(ends)

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            """input_ids [rows, prompt + generated]; scores [rows, vocab] for the next token."""
            if self.prompt_width is None:  # first call: nothing generated yet
                self.prompt_width = input_ids.shape[1]
            choosing = input_ids.shape[1] - self.prompt_width + 1  # the token sampled now
            is_end = torch.zeros(scores.shape[1], dtype=torch.bool)
            is_end[eos_ids] = True
            not_yet = (choosing < self.target) | ~self.ends
            now = (choosing == self.target) & self.ends
            scores[not_yet[:, None] & is_end[None, :]] = -float("inf")
            scores[now[:, None] & ~is_end[None, :]] = -float("inf")
            return scores

    return ForcedLengths()


def main(spec_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, TrainerCallback
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

    clock: dict[str, Any] = {"inputs": [], "generation": [], "step": [], "peak_rss_mb": [], "begin": 0.0}
    seen: list[dict[str, float]] = []  # per step: what the loss's forward pass was given

    class ReplayGRPO(GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            started = time.perf_counter()
            batch = batches[len(clock["inputs"])]
            if len(inputs) != len(batch["rewards"]):
                raise RuntimeError(
                    f"TRL asked for {len(inputs)} rollouts, the batch has {len(batch['rewards'])}"
                )
            clock["generation"].append(self._generate_journaled_lengths(batch))
            result = trl_inputs(batch, tok.pad_token_id, group)
            clock["inputs"].append(time.perf_counter() - started)
            return result

        def _generate_journaled_lengths(self, batch: dict[str, Any]) -> float:
            """TRL's own generation of the batch's prompts, each sample held to its journaled
            length; returns its seconds."""
            lengths = [len(c) for c in batch["completion_ids"]]
            ends = [bool(c) and c[-1] in self.eos_token_ids for c in batch["completion_ids"]]
            processor = forced_lengths(lengths, ends, list(self.eos_token_ids), self.max_completion_length)
            model = self.accelerator.unwrap_model(self.model_wrapped)
            model.generate = functools.partial(
                model.generate, logits_processor=LogitsProcessorList([processor])
            )
            started = time.perf_counter()
            try:
                completions, _ = self._generate_single_turn(batch["prompt_ids"], None, {}, group)
            finally:
                del model.generate  # the instance attribute; the class's method again
            seconds = time.perf_counter() - started
            made = [len(c) for c in completions]
            if made != lengths:
                raise RuntimeError(f"TRL generated {made} tokens per sample, the journal holds {lengths}")
            return seconds

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
            clock["peak_rss_mb"].append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

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
            {"step": i + 1, "seconds": s, "generation_s": g, "train_s": s - i_s, "peak_rss_mb": m, **n}
            for i, (s, g, i_s, m, n) in enumerate(
                zip(
                    clock["step"],
                    clock["generation"],
                    clock["inputs"],
                    clock["peak_rss_mb"],
                    seen,
                    strict=True,
                )
            )
        ],
        "wall_s": wall,
        "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
    }
    write_result(out, "trl_replay", result)


if __name__ == "__main__":
    main(sys.argv[1])
