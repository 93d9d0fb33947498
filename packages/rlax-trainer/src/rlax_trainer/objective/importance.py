"""Importance weights `IS = pi_theta / pi_old` with their masks and truncations."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import msgspec

__all__ = ["ImportanceConfig", "importance_weights"]


class ImportanceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the importance weight is formed.

    - `level`: `token` ratios, or one `sequence` ratio per rollout,
      `exp(mean_t(logp - old))` (GSPO), broadcast to its tokens.
    - `clip`: `mask` zeroes the weight where PPO's clipped surrogate has no gradient
      (A > 0 and ratio > 1 + eps_high, or A < 0 and ratio < 1 - eps_low);
      `truncate` uses `clip(ratio, 1 - eps_low, 1 + eps_high)` as the (stop-gradient)
      weight, CISPO's clipped-IS term; `none` keeps the plain ratio.
    - `tis_cap`: truncated IS against the inference engine's logprobs: every token is
      further weighted by `min(pi_old / pi_infer, tis_cap)`.
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


def importance_weights(
    cfg: ImportanceConfig,
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    infer_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """All inputs [B, T] float32 -> (weights: [B, T] float32, stop-gradient, zero off-mask;
    statistics of the raw ratio and the clipped fraction)."""
    logprobs = jax.lax.stop_gradient(logprobs)
    log_ratio = (logprobs - old_logprobs) * mask
    if cfg.level == "token":
        ratio = jnp.exp(log_ratio)
    else:
        lengths = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        ratio = jnp.broadcast_to(jnp.exp(log_ratio.sum(axis=1, keepdims=True) / lengths), mask.shape)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    clipped = jnp.zeros_like(mask)
    if cfg.clip == "mask":
        clipped = (((advantages > 0) & (ratio > hi)) | ((advantages < 0) & (ratio < lo))).astype(jnp.float32)
        weight = ratio * (1.0 - clipped)
    elif cfg.clip == "truncate":
        clipped = ((ratio > hi) | (ratio < lo)).astype(jnp.float32)
        weight = jnp.clip(ratio, lo, hi)
    else:
        weight = ratio
    if cfg.tis_cap is not None:
        if infer_logprobs is None:
            raise ValueError("tis_cap is set but no inference-engine logprobs (infer_logprobs) were given")
        weight = weight * jnp.minimum(jnp.exp((old_logprobs - infer_logprobs) * mask), cfg.tis_cap)
    weight = weight * mask
    n = jnp.maximum(mask.sum(), 1.0)
    big = jnp.finfo(jnp.float32).max
    stats = {
        "is_ratio_mean": (ratio * mask).sum() / n,
        "is_ratio_max": jnp.where(mask > 0, ratio, -big).max(),
        "is_ratio_min": jnp.where(mask > 0, ratio, big).min(),
        "clip_fraction": (clipped * mask).sum() / n,
    }
    return jax.lax.stop_gradient(weight), stats
