"""Advantage estimators: the `sg[Adv]` factor of the objective.

Every estimator is a typed, frozen config that also computes: a plug-in point chosen
by a registry keyed on `kind`, never by string `if`s scattered through the learner.

Batch layout shared by all estimators: `B = num_groups * group_size` rows, the G
samples of one prompt contiguous; `mask: [B, T]` marks response tokens (1.0) within
the padded token axis (prompt positions and padding are 0.0).

`compute` pays each row one reward (`credit: trajectory`). For `credit: per_turn`
(`turn_credit.py`) the critic-free estimators also baseline per-turn returns
(`compute_turns`, the `TurnAdvantageEstimator` protocol) and GAE reads a reward per token
(`compute_token_rewards`, the `TokenRewardEstimator` protocol).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import msgspec

__all__ = [
    "ADVANTAGE_REGISTRY",
    "AdvantageEstimator",
    "BatchNormalized",
    "GAE",
    "GroupCentered",
    "GroupNormalized",
    "LeaveOneOut",
    "TokenRewardEstimator",
    "TurnAdvantageEstimator",
    "advantage_from_dict",
    "register_advantage",
]


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Turns rewards (and, for critics, values) into per-token advantages."""

    kind: ClassVar[str]
    needs_values: ClassVar[bool]

    def compute(
        self,
        rewards: jax.Array,
        mask: jax.Array,
        group_size: int,
        values: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """rewards: [B] f32, mask: [B, T] f32, values: [B, T] f32 or None ->
        (advantages: [B, T] f32 (zero off-mask), returns: [B, T] f32 or None)."""
        ...


@runtime_checkable
class TurnAdvantageEstimator(Protocol):
    """A critic-free estimator that also baselines the returns of a trajectory's turns."""

    def compute_turns(self, returns: jax.Array, valid: jax.Array, group_size: int) -> jax.Array:
        """returns: [B, K] f32, the return of row b's turn k; valid: [B, K] f32, 1.0 where row
        b has a turn k -> advantages: [B, K] f32 (zero where not valid). Turn k of a row is
        compared with turn k of the other rows of its group (the rows that have one)."""
        ...


@runtime_checkable
class TokenRewardEstimator(Protocol):
    """A critic estimator that reads a reward per token (each turn's at its last token)."""

    def compute_token_rewards(
        self, token_rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None]:
        """token_rewards, mask, values: [B, T] f32 -> (advantages [B, T], returns [B, T])."""
        ...


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    b = rewards.shape[0]
    if b % group_size:
        raise ValueError(f"batch of {b} rollouts is not a whole number of groups of group_size={group_size}")
    return rewards.reshape(b // group_size, group_size)


def _broadcast(seq_adv: jax.Array, mask: jax.Array) -> jax.Array:
    return seq_adv[:, None] * mask


def _turn_groups(
    returns: jax.Array, valid: jax.Array, group_size: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """[B, K] returns and validity -> per group: returns g and validity v [NG, G, K], the
    number n [NG, 1, K] of the group's rows that have turn k, and the mean of their returns
    (0 where none has)."""
    num_groups = _grouped(returns[:, 0], group_size).shape[0]
    v = valid.astype(jnp.float32).reshape(num_groups, group_size, -1)
    g = returns.astype(jnp.float32).reshape(v.shape) * v
    n = v.sum(axis=1, keepdims=True)
    return g, v, n, g.sum(axis=1, keepdims=True) / jnp.maximum(n, 1.0)


class GroupNormalized(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """GRPO: `(R_i - mean_g) / (std_g + eps)` within each group of G samples."""

    kind: ClassVar[str] = "group_norm"
    needs_values: ClassVar[bool] = False
    eps: float = 1e-6
    ddof: int = 0

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.ddof not in (0, 1):
            raise ValueError(f"ddof must be 0 or 1, got {self.ddof}")

    def compute(
        self, rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        g = _grouped(rewards.astype(jnp.float32), group_size)
        if self.ddof == 1 and group_size < 2:
            raise ValueError("ddof=1 needs group_size >= 2")
        mean = g.mean(axis=1, keepdims=True)
        std = jnp.sqrt(((g - mean) ** 2).sum(axis=1, keepdims=True) / (group_size - self.ddof))
        return _broadcast(((g - mean) / (std + self.eps)).reshape(-1), mask), None

    def compute_turns(self, returns: jax.Array, valid: jax.Array, group_size: int) -> jax.Array:
        """Per turn index k: `(G_k - mean_k) / (std_k + eps)` over the group's rows with a
        turn k (0 where only one has: nothing to compare it with)."""
        if self.ddof == 1 and group_size < 2:
            raise ValueError("ddof=1 needs group_size >= 2")
        g, v, n, mean = _turn_groups(returns, valid, group_size)
        var = (((g - mean) * v) ** 2).sum(axis=1, keepdims=True) / jnp.maximum(n - self.ddof, 1.0)
        return ((g - mean) / (jnp.sqrt(var) + self.eps) * v).reshape(returns.shape)


class GroupCentered(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Dr. GRPO / REINFORCE with a group-mean baseline: `R_i - mean_g` (no std division)."""

    kind: ClassVar[str] = "group_centered"
    needs_values: ClassVar[bool] = False

    def compute(
        self, rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        g = _grouped(rewards.astype(jnp.float32), group_size)
        return _broadcast((g - g.mean(axis=1, keepdims=True)).reshape(-1), mask), None

    def compute_turns(self, returns: jax.Array, valid: jax.Array, group_size: int) -> jax.Array:
        """Per turn index k: `G_k - mean_k` over the group's rows with a turn k."""
        g, v, _, mean = _turn_groups(returns, valid, group_size)
        return ((g - mean) * v).reshape(returns.shape)


class LeaveOneOut(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """RLOO: `R_i - mean_{j != i} R_j` within each group."""

    kind: ClassVar[str] = "leave_one_out"
    needs_values: ClassVar[bool] = False

    def compute(
        self, rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        if group_size < 2:
            raise ValueError(f"leave_one_out needs group_size >= 2, got {group_size}")
        g = _grouped(rewards.astype(jnp.float32), group_size)
        others = (g.sum(axis=1, keepdims=True) - g) / (group_size - 1)
        return _broadcast((g - others).reshape(-1), mask), None

    def compute_turns(self, returns: jax.Array, valid: jax.Array, group_size: int) -> jax.Array:
        """Per turn index k: `G_k - mean of the other rows' G_k` over the group's rows with a
        turn k (0 where only one has)."""
        if group_size < 2:
            raise ValueError(f"leave_one_out needs group_size >= 2, got {group_size}")
        g, v, n, _ = _turn_groups(returns, valid, group_size)
        others = (g.sum(axis=1, keepdims=True) - g) / jnp.maximum(n - 1.0, 1.0)
        return (jnp.where(n >= 2, g - others, 0.0) * v).reshape(returns.shape)


class BatchNormalized(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """REINFORCE++: whiten over the whole batch, optionally after subtracting group means."""

    kind: ClassVar[str] = "batch_norm"
    needs_values: ClassVar[bool] = False
    eps: float = 1e-6
    subtract_group_mean: bool = False

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")

    def compute(
        self, rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        g = _grouped(rewards.astype(jnp.float32), group_size)
        if self.subtract_group_mean:
            g = g - g.mean(axis=1, keepdims=True)
        r = g.reshape(-1)
        return _broadcast((r - r.mean()) / (r.std() + self.eps), mask), None

    def compute_turns(self, returns: jax.Array, valid: jax.Array, group_size: int) -> jax.Array:
        """Whiten the returns of every turn of the batch (each turn one entry), optionally
        after subtracting the per-turn-index group means."""
        g, v, _, mean = _turn_groups(returns, valid, group_size)
        if self.subtract_group_mean:
            g = (g - mean) * v
        count = jnp.maximum(v.sum(), 1.0)
        batch_mean = g.sum() / count
        std = jnp.sqrt((((g - batch_mean) * v) ** 2).sum() / count)
        return ((g - batch_mean) / (std + self.eps) * v).reshape(returns.shape)


class GAE(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """PPO: generalised advantage estimation from a value head.

    `compute` (`credit: trajectory`): the scalar reward is paid on the last token of each
    run of response tokens and the value after it is 0, so each model turn of a multi-turn
    row is an episode of its own, paid the trajectory's reward.
    `compute_token_rewards` (`credit: per_turn`): each turn's reward is paid on its last
    token, and environment tokens are skipped (they are no actions): the value after a
    turn's last token is that of the next turn's first token, so the return of a turn holds
    every later turn's reward, discounted by `gamma` per model token (and `lam` for GAE).
    `normalize` whitens advantages over all response tokens.
    """

    kind: ClassVar[str] = "gae"
    needs_values: ClassVar[bool] = True
    gamma: float = 1.0
    lam: float = 0.95
    normalize: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")

    def compute(
        self, rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        if values is None:
            raise ValueError("gae advantages need `values` [B, T] from the value head")
        _grouped(rewards, group_size)
        mask = mask.astype(jnp.float32)
        values = values.astype(jnp.float32) * mask
        next_mask = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
        is_last = mask * (1.0 - next_mask)
        token_rewards = is_last * rewards.astype(jnp.float32)[:, None]
        next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1) * next_mask
        deltas = (token_rewards + self.gamma * next_values - values) * mask

        def step(carry: jax.Array, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            delta, m_next, m = xs
            adv = (delta + self.gamma * self.lam * m_next * carry) * m
            return adv, adv

        _, adv_t = jax.lax.scan(
            step, jnp.zeros_like(rewards, dtype=jnp.float32), (deltas.T, next_mask.T, mask.T), reverse=True
        )
        adv = adv_t.T
        returns = adv + values
        if self.normalize:
            adv = _whiten_tokens(adv, mask, self.eps)
        return adv, returns

    def compute_token_rewards(
        self, token_rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        if values is None:
            raise ValueError("gae advantages need `values` [B, T] from the value head")
        _grouped(token_rewards[:, 0], group_size)
        mask = mask.astype(jnp.float32)
        values = values.astype(jnp.float32) * mask
        token_rewards = token_rewards.astype(jnp.float32) * mask

        def step(
            carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
            # carry: the value and advantage of the next model token (0 after the last).
            next_value, next_adv = carry
            reward, value, m = xs
            adv = reward + self.gamma * next_value - value + self.gamma * self.lam * next_adv
            model = m > 0
            # An environment (or prompt) token passes the next model token's on unchanged.
            carry = (jnp.where(model, value, next_value), jnp.where(model, adv, next_adv))
            return carry, jnp.where(model, adv, 0.0)

        zeros = jnp.zeros(mask.shape[:1], jnp.float32)
        _, adv_t = jax.lax.scan(step, (zeros, zeros), (token_rewards.T, values.T, mask.T), reverse=True)
        adv = adv_t.T
        returns = adv + values
        if self.normalize:
            adv = _whiten_tokens(adv, mask, self.eps)
        return adv, returns


def _whiten_tokens(adv: jax.Array, mask: jax.Array, eps: float) -> jax.Array:
    """adv, mask: [B, T] -> adv whitened over the response tokens (zero off-mask)."""
    n = jnp.maximum(mask.sum(), 1.0)
    mean = (adv * mask).sum() / n
    std = jnp.sqrt((((adv - mean) * mask) ** 2).sum() / n)
    return (adv - mean) / (std + eps) * mask


ADVANTAGE_REGISTRY: dict[str, type] = {}


def register_advantage(cls: type) -> type:
    """Register a msgspec.Struct config class with a `kind` ClassVar and a `compute` method."""
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} needs a non-empty `kind: ClassVar[str]`")
    if not callable(getattr(cls, "compute", None)):
        raise TypeError(f"{cls.__name__} needs a `compute(rewards, mask, group_size, values)` method")
    if kind in ADVANTAGE_REGISTRY and ADVANTAGE_REGISTRY[kind] is not cls:
        raise ValueError(
            f"advantage kind {kind!r} is already registered by {ADVANTAGE_REGISTRY[kind].__name__}"
        )
    ADVANTAGE_REGISTRY[kind] = cls
    return cls


for _cls in (GroupNormalized, GroupCentered, LeaveOneOut, BatchNormalized, GAE):
    register_advantage(_cls)


def advantage_from_dict(obj: object) -> AdvantageEstimator:
    """Build an estimator from `{"kind": name, **fields}` (as read from YAML)."""
    if isinstance(obj, AdvantageEstimator) and not isinstance(obj, dict):
        return obj
    if not isinstance(obj, dict):
        raise ValueError(f"advantage must be a mapping with a `kind`, got {obj!r}")
    fields = dict(obj)
    kind = fields.pop("kind", None)
    if kind not in ADVANTAGE_REGISTRY:
        raise ValueError(f"unknown advantage kind {kind!r}; known: {sorted(ADVANTAGE_REGISTRY)}")
    try:
        return msgspec.convert(fields, ADVANTAGE_REGISTRY[kind])
    except msgspec.ValidationError as e:
        raise ValueError(f"advantage kind {kind!r}: {e}") from None


def advantage_to_dict(est: AdvantageEstimator) -> dict[str, Any]:
    return {"kind": est.kind, **msgspec.to_builtins(est)}
