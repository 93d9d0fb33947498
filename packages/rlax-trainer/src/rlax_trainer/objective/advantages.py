"""Advantage estimators: the `sg[Adv]` factor of the objective.

Every estimator is a typed, frozen config that also computes: a plug-in point chosen
by a registry keyed on `kind`, never by string `if`s scattered through the learner.

Batch layout shared by all estimators: `B = num_groups * group_size` rows, the G
samples of one prompt contiguous; `mask: [B, T]` marks response tokens (1.0) within
the padded token axis (prompt positions and padding are 0.0).
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


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    b = rewards.shape[0]
    if b % group_size:
        raise ValueError(f"batch of {b} rollouts is not a whole number of groups of group_size={group_size}")
    return rewards.reshape(b // group_size, group_size)


def _broadcast(seq_adv: jax.Array, mask: jax.Array) -> jax.Array:
    return seq_adv[:, None] * mask


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


class GroupCentered(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Dr. GRPO / REINFORCE with a group-mean baseline: `R_i - mean_g` (no std division)."""

    kind: ClassVar[str] = "group_centered"
    needs_values: ClassVar[bool] = False

    def compute(
        self, rewards: jax.Array, mask: jax.Array, group_size: int, values: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        g = _grouped(rewards.astype(jnp.float32), group_size)
        return _broadcast((g - g.mean(axis=1, keepdims=True)).reshape(-1), mask), None


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


class GAE(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """PPO: generalised advantage estimation from a value head.

    The scalar reward is paid on the last response token; the value after the last
    response token is 0. `normalize` whitens advantages over all response tokens.
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
            n = jnp.maximum(mask.sum(), 1.0)
            mean = (adv * mask).sum() / n
            std = jnp.sqrt((((adv - mean) * mask) ** 2).sum() / n)
            adv = (adv - mean) / (std + self.eps) * mask
        return adv, returns


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
