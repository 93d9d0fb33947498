"""Aggregation weights: the `Agg` factor of the objective.

The loss is the mean over groups of the formula's per-group sum, so its scale does not
depend on how many groups a batch holds. Weights are computed once on the whole global
batch, before it is split into micro-batches, which makes gradient accumulation a plain
sum of micro-batch gradients whatever the aggregation.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["Aggregation", "aggregation_weights"]

Aggregation = Literal["sequence", "token_mean", "max_length"]


def aggregation_weights(
    kind: Aggregation, mask: jax.Array, group_size: int, max_length: int | None = None
) -> jax.Array:
    """mask: [B, T] (1.0 on response tokens) -> weights: [B, T] float32, zero off-mask.

    - `sequence`:   1 / (num_groups * G * |o_i|)      (GRPO)
    - `token_mean`: 1 / (num_groups * sum_group |o|)  (DAPO)
    - `max_length`: 1 / (num_groups * G * L_max)      (Dr. GRPO); L_max defaults to T.
    """
    mask = mask.astype(jnp.float32)
    b, t = mask.shape
    if group_size < 1 or b % group_size:
        raise ValueError(f"batch of {b} rollouts is not a whole number of groups of group_size={group_size}")
    num_groups = b // group_size
    lengths = mask.sum(axis=1)
    if kind == "sequence":
        w = 1.0 / (num_groups * group_size * jnp.maximum(lengths, 1.0))
        return w[:, None] * mask
    if kind == "token_mean":
        per_group = lengths.reshape(num_groups, group_size).sum(axis=1)
        w = 1.0 / (num_groups * jnp.maximum(per_group, 1.0))
        return jnp.repeat(w, group_size)[:, None] * mask
    if kind == "max_length":
        l_max = t if max_length is None else max_length
        if l_max < 1:
            raise ValueError(f"max_length must be >= 1, got {l_max}")
        return mask / (num_groups * group_size * l_max)
    raise ValueError(f"unknown aggregation {kind!r}; known: sequence, token_mean, max_length")
