"""Typed configs of the learner and its optimizer, loadable from YAML."""

from __future__ import annotations

import pathlib
from typing import Any, Literal

import msgspec
import optax
import yaml

from rlax_core.config import OptimizerConfig, UpdateOptions
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


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        if cfg.decay_steps < 1:
            # 0 means "the run's length", which a run config resolves (`learner_config`).
            raise ValueError("optimizer.decay_steps must be >= 1 for a cosine schedule")
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


class LearnerConfig(UpdateOptions, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How one update is computed from a batch of `global_batch` rollouts: the run's
    `UpdateOptions` (`micro_batch`, `minibatches`, `minibatch_split`, `remat`, `packing`,
    `pack_length`, `batch_invariant`: defined and documented once, in
    `rlax_core.config.trainer`), and what the learner takes from the rest of the run.

    - `mode`: `rl` (the objective) or `sft` (cross-entropy on completion tokens).
    - `group_size`, `global_batch`: samples per prompt and rollouts per batch (`data:`).
    - `param_dtype`: dtype the forward pass sees; the optimizer always updates float32
      master weights.
    - `temperature`: the sampler's temperature (logprobs of the same distribution).
    - `top_p`, `top_k`: the sampler's filters (1.0 and 0: off). The engine reports the
      log-prob of the truncated, renormalised distribution it drew from, so when either is
      on the trainer recomputes pi_old on that same support for the off-policy correction's
      behaviour weight pi_prox / pi_behav (and the logprob mismatch metrics); the policy
      ratio pi_theta / pi_old stays on the full distribution.
    - `logprob_chunk_size`: tokens (of batch x seq) per chunk of the vocabulary projection +
      softmax, recomputed in the backward pass (never a full [B, S, V] float32 logits
      tensor). None: dense. A micro-batch whose full logits are small
      (`learner.DENSE_LOGITS_ELEMENTS`, 16 MB of float32) runs dense either way: there
      chunking costs time and saves nothing.
    - `trim_padding`: run the update at the batch's longest real sequence rounded up to a
      bucket (`rlax_trainer.padding`), not at the length the batch was padded to (unpacked
      batches only).
    - `optimizer`: `rlax_core.config.OptimizerConfig`.
    """

    objective: ObjectiveConfig | None = None
    mode: Literal["rl", "sft"] = "rl"
    group_size: int = 1
    global_batch: int = 1
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    logprob_chunk_size: int | None = 64
    trim_padding: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    optimizer: OptimizerConfig = OptimizerConfig()

    def __post_init__(self) -> None:
        super().__post_init__()
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
    out: dict[str, Any] = msgspec.to_builtins(msgspec.structs.replace(cfg, objective=None))
    out["objective"] = None if cfg.objective is None else objective_to_dict(cfg.objective)
    return out


def load_learner_config(path: str | pathlib.Path) -> LearnerConfig:
    path = pathlib.Path(path)
    try:
        return learner_config_from_dict(yaml.safe_load(path.read_text()) or {})
    except (msgspec.ValidationError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from None
