"""Typed configs of the learner and its optimizer, loadable from YAML."""

from __future__ import annotations

import pathlib
from typing import Any, Literal

import msgspec
import optax
import yaml

from rlax_trainer.objective import ObjectiveConfig, objective_to_dict
from rlax_trainer.objective.config import decode_hook, resolve_objective_dict

__all__ = [
    "LearnerConfig",
    "OptimizerConfig",
    "learner_config_from_dict",
    "learner_config_to_dict",
    "load_learner_config",
    "make_optimizer",
]

Remat = Literal["none", "full", "nothing_saveable", "dots_saveable"]


class OptimizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """AdamW with linear warm-up to `lr`, then constant or cosine decay to `lr * min_lr_ratio`
    over `decay_steps`; gradients clipped to global norm `max_grad_norm` (None: no clipping)."""

    lr: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    decay_steps: int = 1000
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1, got {self.decay_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        after = optax.cosine_decay_schedule(cfg.lr, cfg.decay_steps, alpha=cfg.min_lr_ratio)
    if cfg.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(cfg.lr / (cfg.warmup_steps + 1), cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """AdamW (moments in float32: the master parameters are float32) with global-norm clipping."""
    parts = [] if cfg.max_grad_norm is None else [optax.clip_by_global_norm(cfg.max_grad_norm)]
    parts.append(
        optax.adamw(
            learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    )
    return optax.chain(*parts)


class LearnerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one update is computed from a batch of `global_batch` rollouts.

    - `mode`: `rl` (the objective) or `sft` (cross-entropy on completion tokens).
    - `micro_batch`: rollouts per forward/backward pass (gradients accumulated); must divide
      the rollouts of one minibatch. 0: the whole minibatch at once.
    - `minibatches`: optimizer steps per rollout batch, so that the PPO clip acts between them.
    - `minibatch_split`: how a batch is dealt into its minibatches (seeded by the train
      state's key, so resumption is exact). `rows` (default): the rollouts are shuffled across
      the whole batch, so each minibatch holds samples of about every prompt, as TRL's
      `GRPOTrainer` does; every gradient step then sees all prompts, and its direction is
      far less noisy than with whole groups. `groups`: whole prompt groups per minibatch
      (the previous rule), for objectives whose loss would need a group's samples
      together. Advantages and aggregation weights are formed on the whole batch before
      the split, so no built-in objective needs `groups`.
    - `param_dtype`: dtype the forward pass sees; the optimizer always updates float32
      master weights.
    - `remat`: rematerialisation of each layer; `nothing_saveable` is the "aligned" mode.
    - `temperature`: the sampler's temperature (logprobs of the same distribution).
    - `top_p`, `top_k`: the sampler's filters (1.0 and 0: off). The engine reports the
      log-prob of the truncated, renormalised distribution it drew from, so when either is
      on the trainer recomputes pi_old on that same support for the off-policy correction's
      behaviour weight pi_prox / pi_behav (and the logprob mismatch metrics); the policy
      ratio pi_theta / pi_old stays on the full distribution.
    - `logprob_chunk_size`: tokens (of batch x seq) per chunk of the vocabulary projection + softmax,
      recomputed in the backward pass (never a full [B, S, V] float32 logits tensor).
      None: dense. A micro-batch whose full logits are small (`learner.DENSE_LOGITS_ELEMENTS`,
      16 MB of float32) runs dense either way: there chunking costs time and saves nothing.
    - `trim_padding`: run the update at the batch's longest real sequence rounded up to a
      bucket (`rlax_trainer.padding`), not at the length the batch was padded to (unpacked
      batches only).
    - `packing`: compute only real tokens (`rlax_trainer.packing`): each minibatch's
      rollouts are packed into rows of `pack_length` tokens, a prompt group's common prefix
      once per row, and the model runs one forward/backward pass per row used, so padding
      and repeated prompts cost nothing and every batch has the same shapes (one compiled
      program). `micro_batch` then does not apply: a pass is one packed row. False: rows
      padded to the batch's length bucket, `micro_batch` rollouts per pass.
    - `pack_length`: tokens per packed row (0: `packing.auto_pack_length` of the batch's
      padded length, twice it); memory per pass grows with it, attention quadratically.
    - `batch_invariant`: a rollout's float32 log-probs are bitwise the same whatever it is
      padded to, batched with or packed with: every pass runs the attention over blocks of
      `rlax_model.attention.KEY_BLOCK` keys, packed rows align their segments to them
      (`rlax_trainer.packing`), and the update compiles with
      `rlax_model.layers.ALIGNED_COMPILER_OPTIONS` (row-count invariant matmuls), as the
      engine does in its aligned mode (`rlax_inference.EngineConfig.aligned`, which a run
      turns on with this): a sampled token's log-prob is then the trainer's to the bit.
      Measured on a 2-layer SmolLM2-wide model, 16 rollouts of 47-token prompts: the packed
      update 1.4x the time (1.5x the computed positions), and 3.2x the temporary memory on
      512-token rows. Off, a rollout's log-probs move with its
      padding, batch and row by up to ~3e-6 (the attention's one matmul over all keys).
    """

    objective: ObjectiveConfig | None = None
    mode: Literal["rl", "sft"] = "rl"
    group_size: int = 1
    global_batch: int = 1
    micro_batch: int = 0
    minibatches: int = 1
    minibatch_split: Literal["rows", "groups"] = "rows"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Remat = "none"
    logprob_chunk_size: int | None = 64
    trim_padding: bool = True
    packing: bool = True
    pack_length: int = 0
    batch_invariant: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()

    def __post_init__(self) -> None:
        if self.mode == "rl" and self.objective is None:
            raise ValueError("mode='rl' needs an `objective` (e.g. objective: {base: grpo})")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.global_batch < 1 or self.global_batch % self.group_size:
            raise ValueError(
                f"global_batch={self.global_batch} must be a positive multiple of group_size={self.group_size}"
            )
        if self.minibatches < 1 or self.global_batch % self.minibatches:
            raise ValueError(
                f"minibatches={self.minibatches} must divide global_batch={self.global_batch} into equal minibatches"
            )
        if self.minibatch_split == "groups" and self.global_batch % (self.minibatches * self.group_size):
            raise ValueError(
                f"minibatch_split='groups': minibatches={self.minibatches} must split "
                f"global_batch={self.global_batch} into whole groups of {self.group_size}"
            )
        rows = self.global_batch // self.minibatches
        if self.micro_batch < 0 or (self.micro_batch and rows % self.micro_batch):
            raise ValueError(f"micro_batch={self.micro_batch} must divide the {rows} rollouts of a minibatch")
        if self.pack_length < 0:
            raise ValueError(
                f"pack_length must be >= 0 (0: twice the batch's padded length), got {self.pack_length}"
            )
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")

    @property
    def truncated_sampling(self) -> bool:
        """Whether the sampler draws from a top-p/top-k truncated distribution."""
        return self.top_p < 1.0 or self.top_k > 0

    @property
    def micro(self) -> int:
        return self.micro_batch or self.global_batch // self.minibatches


def learner_config_from_dict(data: dict[str, Any]) -> LearnerConfig:
    """Build from plain data; `objective` may be `{base: <preset>, ...overrides}`.
    Errors name the field path (`$.objective.importance.eps_high`) and the value."""
    if not isinstance(data, dict):
        raise ValueError(f"learner config must be a mapping, got {type(data).__name__}")
    data = dict(data)
    if isinstance(data.get("objective"), dict):
        data["objective"] = resolve_objective_dict(data["objective"])
    return msgspec.convert(data, LearnerConfig, dec_hook=decode_hook)


def learner_config_to_dict(cfg: LearnerConfig) -> dict[str, Any]:
    out = msgspec.to_builtins(msgspec.structs.replace(cfg, objective=None))
    out["objective"] = None if cfg.objective is None else objective_to_dict(cfg.objective)
    return out


def load_learner_config(path: str | pathlib.Path) -> LearnerConfig:
    path = pathlib.Path(path)
    try:
        return learner_config_from_dict(yaml.safe_load(path.read_text()) or {})
    except (msgspec.ValidationError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from None
