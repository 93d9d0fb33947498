"""Importance weights `IS = pi_theta / pi_old` with their masks and truncations."""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import msgspec

__all__ = ["ImportanceConfig", "ImportanceWeights", "importance_weights"]


class ImportanceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the importance weight is formed.

    - `level`: `token` ratios, or one `sequence` ratio per rollout,
      `exp(mean_t(logp - old))` (GSPO), broadcast to its tokens.
    - `clip`: `mask` is PPO's clipped surrogate `min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`:
      where the clip binds (A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low) the
      token keeps the clipped value but has no gradient; `truncate` uses
      `clip(ratio, 1 - eps_low, 1 + eps_high)` as the (stop-gradient) weight of
      `A * log pi`, CISPO's clipped-IS term, so every token keeps a gradient; `none`
      keeps the plain ratio.
    - `tis_cap`: truncated IS against the inference engine's logprobs: every token is
      further weighted by `min(pi_old / pi_infer, tis_cap)`, at the same `level` as the
      ratio (for `sequence`, the length-normalised `exp(mean_t(old - infer))`: a token
      weight inside a sequence ratio would make the gradient no objective's gradient).
    """

    level: Literal["token", "sequence"] = "token"
    clip: Literal["mask", "truncate", "none"] = "mask"
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        if not self.eps_low >= 0:
            raise ValueError(f"eps_low must be >= 0, got {self.eps_low}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")


class ImportanceWeights(NamedTuple):
    """Per-token factors of the policy term `-Agg * A * surrogate`, all [B, T] float32,
    stop-gradient and zero off-mask.

    - `surrogate`: the surrogate's value per unit advantage (`r`, or the clipped ratio
      where the clip binds), times the TIS weight.
    - `gradient`: the factor of `A * grad log pi` in the surrogate's gradient (`r`, or 0
      where the clip binds; the truncated ratio for `truncate`), times the TIS weight.
    """

    surrogate: jax.Array
    gradient: jax.Array
    stats: dict[str, jax.Array]


def importance_weights(
    cfg: ImportanceConfig,
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    infer_logprobs: jax.Array | None = None,
) -> ImportanceWeights:
    """All inputs [B, T] float32 -> ImportanceWeights (its `stats`: the raw ratio's
    mean/max/min over the mask and the fraction of tokens whose ratio was clipped)."""
    logprobs = jax.lax.stop_gradient(logprobs)
    lengths = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)

    def at_level(log_ratio: jax.Array) -> jax.Array:
        if cfg.level == "token":
            return jnp.exp(log_ratio * mask)
        return jnp.broadcast_to(jnp.exp((log_ratio * mask).sum(axis=1, keepdims=True) / lengths), mask.shape)

    ratio = at_level(logprobs - old_logprobs)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    clipped = jnp.zeros_like(mask)
    if cfg.clip == "mask":
        clipped = (((advantages > 0) & (ratio > hi)) | ((advantages < 0) & (ratio < lo))).astype(jnp.float32)
        # min(r A, clip(r) A) is the clipped value exactly where the clip binds.
        surrogate = jnp.where(clipped > 0, jnp.clip(ratio, lo, hi), ratio)
        gradient = ratio * (1.0 - clipped)
    elif cfg.clip == "truncate":
        clipped = ((ratio > hi) | (ratio < lo)).astype(jnp.float32)
        surrogate = gradient = jnp.clip(ratio, lo, hi)
    else:
        surrogate = gradient = ratio
    tis = jnp.ones_like(mask)
    if cfg.tis_cap is not None:
        if infer_logprobs is None:
            raise ValueError("tis_cap is set but no inference-engine logprobs (infer_logprobs) were given")
        tis = jnp.minimum(at_level(old_logprobs - infer_logprobs), cfg.tis_cap)
    n = jnp.maximum(mask.sum(), 1.0)
    big = jnp.finfo(jnp.float32).max
    stats = {
        "is_ratio_mean": (ratio * mask).sum() / n,
        "is_ratio_max": jnp.where(mask > 0, ratio, -big).max(),
        "is_ratio_min": jnp.where(mask > 0, ratio, big).min(),
        "clip_fraction": (clipped * mask).sum() / n,
    }
    sg = jax.lax.stop_gradient
    return ImportanceWeights(sg(surrogate * tis * mask), sg(gradient * tis * mask), stats)
