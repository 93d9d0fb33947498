"""Credit assignment over a trajectory's model turns (`ObjectiveConfig.credit`).

A multi-turn trajectory has K model turns with rewards r_0 .. r_{K-1} (turn k's reward is
the one of the environment step that answered it; the last turn's includes the verifier's
score), laid out per token as `token_rewards: [B, T]` (turn k's reward at its last
token) and `turn_ends: [B, T]` (1.0 there). A rollout without turns is one turn paid its
reward at its last response token.

- `trajectory` (the default; every run before per-turn rewards existed): each row's
  sequence reward R = sum_k r_k goes to the estimator's `compute`, and every token of the
  row gets the one advantage it makes.
- `per_turn`: every token of turn k gets the advantage of the turn's return

      G_k = sum_{k' >= k} gamma^(k' - k) r_{k'}

  Critic-free estimators baseline G_k against turn k of the other rows of its group (the
  rows that have a turn k; `TurnAdvantageEstimator.compute_turns`), as rLLM's per-step mode
  groups steps by task and step index: returns at one depth of the same prompt are
  comparable, where comparing G_2 with another row's G_0 would mix horizons (and, with
  gamma < 1, scales). For the group baselines a turn index that only one row of its
  group reaches gets advantage 0; `batch_norm` whitens every turn of the batch. GAE reads `token_rewards` (turn k's reward at its last token, SkyRL's token-level
  rewards) and discounts per token with its own `gamma`; `credit.gamma` must stay 1.

With one turn per row, `per_turn` is `trajectory` (up to float rounding).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import msgspec

from rlax_trainer.objective.advantages import AdvantageEstimator, TokenRewardEstimator, TurnAdvantageEstimator

__all__ = [
    "CreditAssignment",
    "CreditConfig",
    "discounted_returns",
    "last_response_token",
    "per_turn_advantages",
    "token_turns",
]

CreditAssignment = Literal["trajectory", "per_turn"]


class CreditConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a trajectory's rewards reach its tokens (the module docstring has the formula):
    `assignment: trajectory` (default) or `per_turn`; `gamma`: the discount per model turn
    of `per_turn` returns, in [0, 1] (1.0: every later turn's reward counts in full)."""

    assignment: CreditAssignment = "trajectory"
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gamma) and 0.0 <= self.gamma <= 1.0):
            raise ValueError(f"credit.gamma must be in [0, 1], got {self.gamma}")
        if self.assignment == "trajectory" and self.gamma != 1.0:
            raise ValueError(
                f"credit.gamma={self.gamma} discounts per-turn returns: it needs `assignment: per_turn`"
            )

    def check_estimator(self, estimator: AdvantageEstimator) -> None:
        """ValueError when `estimator` cannot assign credit this way."""
        if self.assignment == "trajectory":
            return
        kind = estimator.kind
        if estimator.needs_values:
            if not isinstance(estimator, TokenRewardEstimator):
                raise ValueError(
                    f"advantage kind {kind!r} reads no per-token rewards (`compute_token_rewards`)"
                )
            if self.gamma != 1.0:
                raise ValueError(
                    f"credit.gamma={self.gamma} with advantage kind {kind!r}: a critic discounts per "
                    "token with the advantage's own `gamma`; leave credit.gamma at 1.0"
                )
        elif not isinstance(estimator, TurnAdvantageEstimator):
            raise ValueError(f"advantage kind {kind!r} has no per-turn baseline (`compute_turns`)")


def last_response_token(mask: jax.Array) -> jax.Array:
    """mask: [B, T] -> [B, T] f32, 1.0 at each row's last response token (none in an empty row)."""
    mask = mask.astype(jnp.float32)
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)
    return jax.nn.one_hot(last, t, dtype=jnp.float32) * (mask.sum(axis=1, keepdims=True) > 0)


def token_turns(turn_ends: jax.Array) -> tuple[jax.Array, jax.Array]:
    """turn_ends: [B, T] (1.0 at each turn's last token) -> (turn: [B, T] int32, the index of
    the turn each token belongs to; valid: [B, T] f32, 1.0 at turn index k < the row's
    number of turns). K = T turns at most: every turn has a token."""
    ends = (turn_ends > 0).astype(jnp.int32)
    turn = jnp.cumsum(ends, axis=1) - ends  # turn ends strictly before the token
    count = ends.sum(axis=1, keepdims=True)
    valid = (jnp.arange(ends.shape[1])[None, :] < count).astype(jnp.float32)
    return turn, valid


def discounted_returns(rewards: jax.Array, gamma: float) -> jax.Array:
    """rewards: [B, K] per turn (0 past the last) -> G: [B, K], G_k = r_k + gamma * G_{k+1}."""

    def step(after: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        g = r + gamma * after
        return g, g

    _, g = jax.lax.scan(step, jnp.zeros(rewards.shape[:1], jnp.float32), rewards.T, reverse=True)
    return g.T


def per_turn_advantages(
    estimator: AdvantageEstimator,
    gamma: float,
    token_rewards: jax.Array,
    turn_ends: jax.Array,
    mask: jax.Array,
    group_size: int,
    values: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """token_rewards, turn_ends, mask (, values): [B, T] f32 -> (advantages [B, T] f32, zero
    off-mask; returns [B, T] f32 for a critic, else None)."""
    mask = mask.astype(jnp.float32)
    token_rewards = token_rewards.astype(jnp.float32) * mask
    if estimator.needs_values:
        assert isinstance(estimator, TokenRewardEstimator)  # CreditConfig.check_estimator
        return estimator.compute_token_rewards(token_rewards, mask, group_size, values)
    assert isinstance(estimator, TurnAdvantageEstimator)
    turn, valid = token_turns(turn_ends)
    rows = jnp.arange(mask.shape[0])[:, None]
    per_turn = jnp.zeros_like(token_rewards).at[rows, turn].add(token_rewards)  # [B, K = T]
    advantages = estimator.compute_turns(discounted_returns(per_turn, gamma), valid, group_size)
    return jnp.take_along_axis(advantages, turn, axis=1) * mask, None
