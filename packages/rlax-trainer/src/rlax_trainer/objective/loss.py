"""The RL objective: a clipped policy surrogate plus regularisers outside it.

Per response token, with `Agg` the aggregation weight, `A` the advantage and `r` the
importance ratio (token- or sequence-level):

    loss = sum Agg * ( -A * surrogate(r)  +  kl.coef * k(logp, ref)  -  entropy_coef * H )

The policy term `-A * surrogate` has the clipped surrogate's value (PPO's
`min(r A, clip(r) A)`, CISPO's truncated ratio), times the off-policy correction's
behaviour weight `w = pi_prox / pi_behav` (decoupled PPO; plain, truncated or masked) and the surrogate's
gradient, which is zero on tokens where the clip binds. The regularisers are functions
of pi_theta at the sampled tokens, weighted by `Agg` only: as in DeepSeekMath's GRPO
(the KL penalty sits outside the clipped surrogate) and PPO's entropy bonus, no ratio,
clip or TIS weight touches them, so their gradient reaches every response token.
PPO's value loss is added the same way (a regression on sampled returns).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlax_trainer.objective.aggregation import aggregation_weights
from rlax_trainer.objective.config import ObjectiveConfig, overlong_penalty, shape_rewards
from rlax_trainer.objective.importance import importance_weights
from rlax_trainer.objective.regularizers import kl_estimate
from rlax_trainer.objective.turn_credit import last_response_token, per_turn_advantages

__all__ = ["PreparedBatch", "objective_loss", "prepare_batch"]

sg = jax.lax.stop_gradient


class PreparedBatch(NamedTuple):
    """Per-token constants of one global batch, computed before it is split into micro-batches."""

    advantages: jax.Array  # [B, T] f32, zero off-mask
    weights: jax.Array  # [B, T] f32 aggregation weights, zero off-mask
    returns: jax.Array | None  # [B, T] f32 (value-head targets) or None
    rewards: jax.Array  # [B] f32 after reward shaping


def prepare_batch(
    cfg: ObjectiveConfig,
    rewards: jax.Array,
    mask: jax.Array,
    group_size: int,
    old_values: jax.Array | None = None,
    *,
    token_rewards: jax.Array | None = None,
    turn_ends: jax.Array | None = None,
) -> PreparedBatch:
    """rewards: [B] f32, mask: [B, T], old_values: [B, T] (critic presets) -> PreparedBatch.

    token_rewards, turn_ends: [B, T] f32, the rows' per-turn rewards (`RolloutBatch`), read
    by `credit: per_turn` only; None: each row is one turn paid `rewards` at its last
    response token. The overlong penalty is paid with the last turn's reward."""
    mask = jnp.asarray(mask, jnp.float32)
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"rewards has shape {rewards.shape}, expected ({mask.shape[0]},) to match mask {mask.shape}"
        )
    lengths = mask.sum(axis=1)
    shaped = shape_rewards(cfg, rewards, lengths)
    values = None if old_values is None else sg(jnp.asarray(old_values, jnp.float32))
    if cfg.credit.assignment == "trajectory":
        adv, returns = cfg.advantage.compute(shaped, mask, group_size, values)
    else:
        if (token_rewards is None) != (turn_ends is None):
            raise ValueError("token_rewards and turn_ends come together (or neither: one turn per row)")
        last = last_response_token(mask)
        if token_rewards is None or turn_ends is None:
            token_rewards, turn_ends = last * rewards[:, None], last
        for name, arr in (("token_rewards", token_rewards), ("turn_ends", turn_ends)):
            if arr.shape != mask.shape:
                raise ValueError(f"{name} has shape {arr.shape}, expected mask's shape {mask.shape}")
        token_rewards = jnp.asarray(token_rewards, jnp.float32)
        if cfg.overlong is not None:
            token_rewards = token_rewards + last * overlong_penalty(cfg.overlong, lengths)[:, None]
        adv, returns = per_turn_advantages(
            cfg.advantage, cfg.credit.gamma, token_rewards, turn_ends, mask, group_size, values
        )
    weights = aggregation_weights(cfg.aggregation, mask, group_size, cfg.max_length)
    return PreparedBatch(sg(adv), weights, None if returns is None else sg(returns), shaped)


def objective_loss(
    cfg: ObjectiveConfig,
    *,
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    mask: jax.Array,
    ref_logprobs: jax.Array | None = None,
    infer_logprobs: jax.Array | None = None,
    sampler_old_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    old_values: jax.Array | None = None,
    returns: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Every array [B, T]; `logprobs`, `entropy` and `values` carry gradients, the rest are
    constants. Computed in float32 whatever the input dtype. `infer_logprobs` are the
    workers' behaviour logprobs pi_behav; `sampler_old_logprobs` pi_prox on the sampler's
    top-p/top-k support for the behaviour weight pi_prox / pi_behav (default `old_logprobs`).

    Returns (scalar loss, metrics); metrics are token means over `mask` except `*_max`/`*_min`.
    """

    def f32(x: jax.Array) -> jax.Array:
        return jnp.asarray(x, jnp.float32)

    def f32_or_none(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else f32(x)

    logprobs, old_logprobs, advantages, weights, mask = map(
        f32, (logprobs, old_logprobs, advantages, weights, mask)
    )
    ref_logprobs, infer_logprobs, entropy = map(f32_or_none, (ref_logprobs, infer_logprobs, entropy))
    sampler_old_logprobs = f32_or_none(sampler_old_logprobs)
    values, old_values, returns = map(f32_or_none, (values, old_values, returns))
    shapes = {
        "logprobs": logprobs,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "weights": weights,
    }
    for name, arr in {
        **shapes,
        "ref_logprobs": ref_logprobs,
        "infer_logprobs": infer_logprobs,
        "sampler_old_logprobs": sampler_old_logprobs,
        "entropy": entropy,
        "values": values,
        "old_values": old_values,
        "returns": returns,
    }.items():
        if arr is not None and arr.shape != mask.shape:
            raise ValueError(f"{name} has shape {arr.shape}, expected mask's shape {mask.shape}")

    iw = importance_weights(
        cfg.importance, logprobs, old_logprobs, advantages, mask, infer_logprobs, sampler_old_logprobs
    )
    weights, advantages = sg(weights), sg(advantages)
    # Value `iw.surrogate`, gradient `iw.gradient * grad logp`: exp(logp - sg[logp]) - 1 is 0
    # with gradient grad logp, so clipped tokens log the clipped value but pass no gradient.
    surrogate = iw.surrogate + iw.gradient * (jnp.exp(logprobs - sg(logprobs)) - 1.0)
    pg_loss = -(weights * advantages * surrogate).sum()
    regularizer = jnp.zeros_like(logprobs)
    n = jnp.maximum(mask.sum(), 1.0)
    metrics = dict(iw.stats)
    if cfg.kl.coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"kl.coef={cfg.kl.coef} needs ref_logprobs from the reference policy")
        regularizer = regularizer + cfg.kl.coef * kl_estimate(cfg.kl.estimator, logprobs, ref_logprobs)
    if ref_logprobs is not None:
        metrics["kl"] = (sg(kl_estimate("k3", logprobs, ref_logprobs)) * mask).sum() / n
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError(f"entropy_coef={cfg.entropy_coef} needs the per-token entropy")
        regularizer = regularizer - cfg.entropy_coef * entropy
    if entropy is not None:
        metrics["entropy"] = (sg(entropy) * mask).sum() / n
    # Outside the surrogate: weighted by Agg alone (zero off-mask), never by a ratio or clip.
    regularizer_loss = (weights * regularizer).sum()
    loss = pg_loss + regularizer_loss
    metrics["pg_loss"] = pg_loss
    metrics["regularizer_loss"] = regularizer_loss
    if cfg.value is not None:
        if values is None or old_values is None or returns is None:
            raise ValueError("the value loss needs values, old_values and returns")
        err = (values - returns) ** 2
        if cfg.value.clip is not None:
            clipped = old_values + jnp.clip(values - old_values, -cfg.value.clip, cfg.value.clip)
            err = jnp.maximum(err, (clipped - returns) ** 2)
        value_loss = (weights * 0.5 * err).sum()
        loss = loss + cfg.value.coef * value_loss
        metrics["value_loss"] = value_loss
    metrics["loss"] = loss
    return loss, metrics
