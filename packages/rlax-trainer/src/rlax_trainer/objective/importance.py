"""Importance weights `IS = pi_theta / pi_old` with their masks and truncations, and the
off-policy (behaviour) correction `w = pi_prox / pi_behav` against the engine's logprobs."""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import msgspec

__all__ = [
    "CorrectionConfig",
    "ImportanceConfig",
    "ImportanceWeights",
    "behaviour_weights",
    "importance_weights",
]


class CorrectionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decoupled PPO's behaviour weight `w = pi_prox / pi_behav` (stop-gradient) on each
    policy term, `w * min(r A, clip(r) A)` with `r = pi_theta / pi_prox` (AReaL, Fu et al. 2025).

    pi_prox is the trainer's recomputed pi_old (`old_logprobs`, on the sampler's top-p/top-k
    support, see the learner), pi_behav the workers' logprobs (`infer_logprobs`).

    - `kind`: `none` (w = 1), `is` (the plain weight w: AReaL's decoupled loss), `tis`
      (truncated, `min(w, upper)`, and `max(., lower)` when `lower` is set; Yao et al. 2025),
      `mis` (masked: `w` where `lower <= w <= upper`, else 0, IcePop-style).
    - `level`: `token` (one w per token), or `sequence` (one w per response, broadcast to its
      tokens): the product `prod_t w_t` (the sequence's own likelihood ratio) when the
      policy ratio is per token, the geometric mean `(prod_t w_t)^(1/|y|)` when it is
      GSPO's length-normalised sequence ratio (the weight then lives on the ratio's scale).
      None: the policy ratio's `level`. `token` under a `sequence` ratio is refused: a
      per-token weight inside one sequence ratio is no objective's gradient.
    - `upper`, `lower`: the bounds (required `upper` for tis/mis; `lower` None: no lower bound).
    """

    kind: Literal["none", "is", "tis", "mis"] = "none"
    level: Literal["token", "sequence"] | None = None
    upper: float | None = None
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.kind in ("tis", "mis") and self.upper is None:
            raise ValueError(f"correction kind {self.kind!r} needs `upper`")
        if self.kind in ("none", "is") and (self.upper is not None or self.lower is not None):
            raise ValueError(f"correction kind {self.kind!r} takes no `upper`/`lower` bounds")
        if self.upper is not None and not self.upper > 0:
            raise ValueError(f"upper must be > 0, got {self.upper}")
        if self.lower is not None and not 0 < self.lower < (self.upper or float("inf")):
            raise ValueError(f"lower must be in (0, upper={self.upper}), got {self.lower}")


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
    - `correction`: the off-policy correction against the engine's logprobs (`CorrectionConfig`).
    - `tis_cap`: the older spelling of `correction: {kind: tis, upper: tis_cap}` at the
      ratio's level: every token weighted by `min(pi_old / pi_infer, tis_cap)` (for
      `sequence`, the length-normalised `exp(mean_t(old - infer))`). Not with `correction`.
    """

    level: Literal["token", "sequence"] = "token"
    clip: Literal["mask", "truncate", "none"] = "mask"
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float | None = None
    correction: CorrectionConfig = CorrectionConfig()

    def __post_init__(self) -> None:
        if not self.eps_low >= 0:
            raise ValueError(f"eps_low must be >= 0, got {self.eps_low}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.tis_cap is not None and self.correction.kind != "none":
            raise ValueError("set either tis_cap (the older spelling) or correction, not both")
        if self.level == "sequence" and self.behaviour_correction.level == "token":
            raise ValueError(
                "correction.level: token under importance.level: sequence is refused (a per-token "
                "weight inside one sequence ratio is no objective's gradient); use sequence"
            )

    @property
    def behaviour_correction(self) -> CorrectionConfig:
        """The correction in force, `tis_cap` resolved and `level` filled in."""
        if self.tis_cap is not None:
            return CorrectionConfig("tis", self.level, upper=self.tis_cap)
        c = self.correction
        return c if c.level is not None else msgspec.structs.replace(c, level=self.level)


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
    sampler_old_logprobs: jax.Array | None = None,
) -> ImportanceWeights:
    """All inputs [B, T] float32 -> ImportanceWeights (its `stats`: the raw ratio's
    mean/max/min over the mask and the fraction of tokens whose ratio was clipped, plus
    `behaviour_weights`' stats when a correction is on).

    `sampler_old_logprobs`: pi_prox on the sampler's support (top-p/top-k truncated, as the
    engine reports pi_behav), used for the behaviour weight only; defaults to `old_logprobs`."""
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
    corr = cfg.behaviour_correction
    behaviour_stats: dict[str, jax.Array] = {}
    if corr.kind != "none":
        if infer_logprobs is None:
            raise ValueError(
                f"correction {corr.kind!r} is set but no inference-engine logprobs (infer_logprobs) were given"
            )
        prox = old_logprobs if sampler_old_logprobs is None else sampler_old_logprobs
        tis, behaviour_stats = behaviour_weights(corr, cfg.level, prox, infer_logprobs, mask)
    n = jnp.maximum(mask.sum(), 1.0)
    big = jnp.finfo(jnp.float32).max
    stats = {
        "is_ratio_mean": (ratio * mask).sum() / n,
        "is_ratio_max": jnp.where(mask > 0, ratio, -big).max(),
        "is_ratio_min": jnp.where(mask > 0, ratio, big).min(),
        "clip_fraction": (clipped * mask).sum() / n,
        **behaviour_stats,
    }
    sg = jax.lax.stop_gradient
    return ImportanceWeights(sg(surrogate * tis * mask), sg(gradient * tis * mask), stats)


def behaviour_weights(
    corr: CorrectionConfig,
    ratio_level: str,
    prox_logprobs: jax.Array,
    behav_logprobs: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The stop-gradient behaviour weight [B, T] (zero off-mask) of `corr` (its `level` set,
    see `ImportanceConfig.behaviour_correction`) and its stats:

    - `behav_ratio_mean`/`_max`/`_min`: the raw `pi_prox / pi_behav` at the correction's
      level, over response tokens (a sequence's weight counts once per token);
    - `behav_corrected_fraction`: response tokens whose weight was truncated or masked;
    - `behav_corrected_seq_fraction`: responses with at least one such token (rows
      without response tokens count as uncorrected).
    """
    prox_logprobs, behav_logprobs = jax.lax.stop_gradient((prox_logprobs, behav_logprobs))
    # `where`, not `* mask`: pi_prox of a token off the sampler's current support is -inf (w = 0).
    log_w = jnp.where(mask > 0, prox_logprobs - behav_logprobs, 0.0)
    if corr.level == "sequence":
        total = log_w.sum(axis=1, keepdims=True)
        if ratio_level == "sequence":  # geometric mean, on GSPO's ratio scale
            total = total / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        log_w = jnp.broadcast_to(total, mask.shape)
    log_hi = jnp.log(corr.upper) if corr.upper is not None else jnp.inf
    log_lo = jnp.log(corr.lower) if corr.lower is not None else -jnp.inf
    outside = (log_w > log_hi) | (log_w < log_lo)
    if corr.kind == "tis":
        weight = jnp.exp(jnp.clip(log_w, log_lo, log_hi))
    elif corr.kind == "mis":
        weight = jnp.where(outside, 0.0, jnp.exp(jnp.where(outside, 0.0, log_w)))
    else:  # "is": the plain decoupled weight
        weight = jnp.exp(log_w)
        outside = jnp.zeros_like(outside)
    corrected = outside.astype(jnp.float32) * mask
    n = jnp.maximum(mask.sum(), 1.0)
    ratio = jnp.exp(jnp.minimum(log_w, 80.0))  # finite for the stats
    big = jnp.finfo(jnp.float32).max
    stats = {
        "behav_ratio_mean": (ratio * mask).sum() / n,
        "behav_ratio_max": jnp.where(mask > 0, ratio, -big).max(),
        "behav_ratio_min": jnp.where(mask > 0, ratio, big).min(),
        "behav_corrected_fraction": corrected.sum() / n,
        "behav_corrected_seq_fraction": (corrected.max(axis=1) > 0).mean(),
    }
    return jax.lax.stop_gradient(weight * mask), stats
