"""Regularisers added outside the clipped surrogate: KL to a frozen reference and entropy."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import msgspec

__all__ = ["KLConfig", "kl_estimate", "token_entropy"]

KLEstimator = Literal["k1", "k2", "k3"]


class KLConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """KL(pi_theta || pi_ref) penalty `coef * k(logp, ref_logp)` per token; coef 0 disables it."""

    coef: float = 0.0
    estimator: KLEstimator = "k3"

    def __post_init__(self) -> None:
        if not self.coef >= 0:
            raise ValueError(f"coef must be >= 0, got {self.coef}")


def kl_estimate(estimator: KLEstimator, logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta; [B, T] -> [B, T].

    With `d = ref - logp`: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d.
    """
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return jnp.exp(d) - 1.0 - d
    raise ValueError(f"unknown KL estimator {estimator!r}; known: k1, k2, k3")


def token_entropy(logits: jax.Array) -> jax.Array:
    """logits: [B, T, V] -> entropy of the softmax per position: [B, T] float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)
