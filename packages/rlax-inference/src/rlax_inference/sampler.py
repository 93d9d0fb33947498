"""Token sampling with per-row seeds: greedy, temperature, top-k and top-p.

Every row draws with its own key, `fold_in(fold_in(key(seed), sample_index), step)`, so
a row's token depends only on its logits and (seed, sample_index, step): not on the
batch it sits in, its position there, or whether it was preempted and recomputed.

Logprobs are those of the distribution the token was drawn from: the temperature-scaled
softmax restricted to the top-k, then top-p set (renormalised). A greedy row (temperature
0) reports the logprob of its argmax under the unmodified model distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingBatch(NamedTuple):
    """Per-row sampling settings of one step (all `[batch]`)."""

    temperature: jax.Array  # float32; 0 = greedy
    top_p: jax.Array  # float32 in (0, 1]
    top_k: jax.Array  # int32; 0 = off
    seed: jax.Array  # uint32
    sample_index: jax.Array  # int32
    step: jax.Array  # int32: index of the generated token within its sample

    @staticmethod
    def from_rows(rows: list[tuple[float, float, int, int, int, int]]) -> SamplingBatch:
        """Build from `(temperature, top_p, top_k, seed, sample_index, step)` rows (host numpy)."""
        a = np.asarray(rows, dtype=np.float64).reshape(len(rows), 6)
        return SamplingBatch(
            a[:, 0].astype(np.float32),
            a[:, 1].astype(np.float32),
            a[:, 2].astype(np.int32),
            a[:, 3].astype(np.uint32),
            a[:, 4].astype(np.int32),
            a[:, 5].astype(np.int32),
        )


class SamplerOutput(NamedTuple):
    tokens: jax.Array  # [batch] int32
    logprobs: jax.Array  # [batch] float32, of the sampled token
    top_ids: jax.Array  # [batch, num_top] int32
    top_logprobs: jax.Array  # [batch, num_top] float32


def row_key(seed: jax.Array, sample_index: jax.Array, step: jax.Array) -> jax.Array:
    """The PRNG key of one draw, a function of (seed, sample_index, step) only."""
    key = jax.random.key(seed.astype(jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(key, sample_index), step)


def filtered_logits(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array
) -> jax.Array:
    """One row's logits after temperature, top-k and top-p (dropped entries are -inf).

    logits: [vocab] float32. Top-p keeps the smallest set of most likely tokens whose
    probability (renormalised after top-k) reaches `top_p`; the most likely token is always kept.
    """
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    order = jnp.argsort(-scaled)
    sorted_vals = scaled[order]
    rank = jnp.arange(vocab, dtype=jnp.int32)
    keep = (top_k <= 0) | (rank < top_k)
    sorted_vals = jnp.where(keep, sorted_vals, -jnp.inf)
    probs = jax.nn.softmax(sorted_vals)
    before = jnp.cumsum(probs) - probs
    keep = keep & ((before < top_p) | (rank == 0))
    kept_sorted = jnp.where(keep, sorted_vals, -jnp.inf)
    return jnp.zeros_like(scaled).at[order].set(kept_sorted)


def _sample_row(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    key: jax.Array,
    *,
    use_filters: bool,
    num_top: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    greedy = temperature <= 0
    if use_filters:
        dist = filtered_logits(logits, temperature, top_p, top_k)
    else:
        dist = logits / jnp.where(greedy, 1.0, temperature)
    dist = jnp.where(greedy, logits, dist)
    logp = jax.nn.log_softmax(dist)
    # Inverse-CDF draw: one uniform per row instead of a Gumbel per vocabulary entry
    # (jax.random.categorical), which costs more than the model's matmuls at large batch.
    cdf = jnp.cumsum(jnp.exp(logp))
    target = jax.random.uniform(key, dtype=jnp.float32) * cdf[-1]
    drawn = jnp.sum(cdf <= target)  # first index whose cdf exceeds the target; zero-width entries skipped
    drawn = jnp.where(drawn >= logits.shape[-1], jnp.argmax(dist), drawn)  # u*total rounded up to total
    token = jnp.where(greedy, jnp.argmax(logits), drawn).astype(jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logp, num_top) if num_top else (logp[:0], jnp.zeros((0,), jnp.int32))
    return token, logp[token], top_ids.astype(jnp.int32), top_lp


def sample(
    logits: jax.Array, batch: SamplingBatch, *, use_filters: bool = True, num_top: int = 0
) -> SamplerOutput:
    """Draw one token per row.

    logits: [batch, vocab] float32. `use_filters=False` skips the per-row sort (exact only
    when no row uses top-k or top-p). `num_top`: how many top logprobs to return per row.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {logits.shape}")
    keys = jax.vmap(row_key)(
        jnp.asarray(batch.seed), jnp.asarray(batch.sample_index), jnp.asarray(batch.step)
    )
    fn = jax.vmap(
        lambda lg, t, p, k, key: _sample_row(lg, t, p, k, key, use_filters=use_filters, num_top=num_top)
    )
    tokens, lps, top_ids, top_lps = fn(
        logits.astype(jnp.float32),
        jnp.asarray(batch.temperature),
        jnp.asarray(batch.top_p),
        jnp.asarray(batch.top_k),
        keys,
    )
    return SamplerOutput(tokens, lps, top_ids, top_lps)


sample_jit = jax.jit(sample, static_argnames=("use_filters", "num_top"))
