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

from rlax_model import token_logprobs_from_logits


class SamplingBatch(NamedTuple):
    """Per-row sampling settings of one step (all `[batch]`): host numpy arrays as `from_rows`
    builds them, device arrays (or tracers) inside the jitted steps."""

    temperature: jax.Array | np.ndarray  # float32; 0 = greedy
    top_p: jax.Array | np.ndarray  # float32 in (0, 1]
    top_k: jax.Array | np.ndarray  # int32; 0 = off
    seed: jax.Array | np.ndarray  # uint32
    sample_index: jax.Array | np.ndarray  # int32
    step: jax.Array | np.ndarray  # int32: index of the generated token within its sample

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


def cdf_block_size(vocab: int) -> int:
    """Entries per block of the two-level draw: the largest divisor of `vocab` in [64, 256], else 256 (padded)."""
    return next((b for b in range(256, 63, -1) if vocab % b == 0), 256)


def fine_uniform(bits: jax.Array) -> jax.Array:
    """Uniform float32 in [0, 1) from 46 random bits: `bits` [..., 2] uint32 -> [...].

    `jax.random.uniform` keeps 23 bits, so its 0 alone has probability 2^-23: an inverse-CDF
    draw with it gives the first token of the vocabulary at least that chance, and any
    interval of the CDF narrower than 2^-23 of the mass a probability of 0 or 2^-23. The
    second word refines the first below its last bit; the sum is rounded to float32 (24 bits
    near 1, finer near 0), the precision the float32 CDF it is compared with has anyway.
    """
    coarse = (bits[..., 0] >> 9).astype(jnp.float32) * np.float32(2.0**-23)
    fine = (bits[..., 1] >> 9).astype(jnp.float32) * np.float32(2.0**-46)
    return jnp.minimum(coarse + fine, np.float32(1.0 - 2.0**-24))  # rounding may reach 1.0


def _first_above(weights: jax.Array, cdf: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the first entry of positive weight whose inclusive CDF exceeds `target`, else
    the last entry of positive weight (a target at or past the end of the mass).

    weights, cdf: [rows, n] (cdf is weights' inclusive cumsum); target: [rows]. Returns [rows]
    int32. Never an entry of weight 0, whatever the rounding of `cdf`: the condition asks for
    a positive weight rather than trusting that a zero-width entry has cdf equal to its
    predecessor's (XLA's scan need not add in order). 0 when no weight is positive.
    """
    n = weights.shape[-1]
    index = jnp.arange(n, dtype=jnp.int32)
    positive = weights > 0
    first = jnp.min(jnp.where(positive & (cdf > target[:, None]), index, n), axis=-1)
    last = jnp.max(jnp.where(positive, index, 0), axis=-1)
    return jnp.minimum(first, last)


def _pick_block(
    block_sums: jax.Array, block_cdf: jax.Array, target: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per row, the block holding `target` and the residual of `target` inside it.

    block_sums: [rows, num_blocks] >= 0; block_cdf: their inclusive cumsum; target: [rows]
    in [0, block_cdf[:, -1]). Returns ([rows] int32, a block of positive sum; [rows] float32
    >= 0, `target` minus the CDF of the block before it -- the very value the block was
    chosen against, so the residual is where the target lies in the block's own CDF).
    """
    chosen = _first_above(block_sums, block_cdf, target)
    before = jnp.take_along_axis(block_cdf, jnp.maximum(chosen - 1, 0)[:, None], axis=-1)[:, 0]
    before = jnp.where(chosen > 0, before, 0.0)
    return chosen, jnp.maximum(target - before, 0.0)


def _pick_in_block(weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the entry of `weights` [rows, block] whose range of the block's own CDF holds `target` [rows]."""
    return _first_above(weights, jnp.cumsum(weights, axis=-1), target)


def inverse_cdf_draw(weights: jax.Array, target: jax.Array) -> jax.Array:
    """First entry of positive weight whose cumulative weight exceeds `target`, else the last
    entry of positive weight; entries of weight 0 are never chosen.

    weights: [vocab] float32 >= 0, not all zero; target: float32 scalar in [0, sum(weights)).
    The single-target form of the draw `sample` makes (there fused with the softmax, and the
    entry drawn with a second uniform): a full-vocabulary cumsum costs more than the LM head
    on CPU (XLA lowers it to a log-depth scan), so the draw picks a block from the block
    sums, then the entry inside that block from the residual. Returns int32.
    """
    vocab = weights.shape[0]
    block = cdf_block_size(vocab)
    blocks = jnp.pad(weights, (0, -vocab % block)).reshape(-1, block)  # [num_blocks, block]
    block_sums = blocks.sum(axis=-1)[None]
    chosen, residual = _pick_block(block_sums, jnp.cumsum(block_sums, axis=-1), target[None])
    return _pick_in_block(blocks[chosen[0]][None], residual)[0] + chosen[0] * block


def sample(
    logits: jax.Array,
    batch: SamplingBatch,
    *,
    use_filters: bool = True,
    num_top: int = 0,
    aligned: bool = False,
) -> SamplerOutput:
    """Draw one token per row.

    logits: [batch, vocab] float32. `use_filters=False` skips the per-row sort (exact only
    when no row uses top-k or top-p). `num_top`: how many top logprobs to return per row
    (`top_ids, top_logprobs: [batch, num_top]`; past the vocabulary, ids 0 with logprob -inf).
    `aligned`: the sampled token's log-prob is the trainer's formula
    (`rlax_model.token_logprobs_from_logits`: ordered sums over the vocabulary), so that it
    equals the trainer's recomputation to the bit when the logits do; otherwise it comes
    from the draw's block sums (a few 1e-7 apart, relatively).

    The draw is an inverse CDF (a Gumbel per vocabulary entry, as `jax.random.categorical`
    draws, costs more than the model's matmuls at large batch) in two stages over blocks of
    the vocabulary, each with its own 46-bit uniform (`fine_uniform`): the block from the
    block sums, then the entry from the chosen block's own CDF. The logits are viewed as
    `[rows, blocks, block]` from the start and the temperature is applied inside each pass:
    XLA on CPU then fuses every pass into one vectorised loop (a flat softmax, or a
    temperature broadcast over `[rows, vocab]`, ran 5-7x slower), and no scaled or
    exponentiated copy of the logits is ever written to memory.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {logits.shape}")
    rows, vocab = logits.shape
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(batch.temperature)
    greedy = temperature <= 0
    if use_filters:
        dist = jax.vmap(filtered_logits)(
            logits, temperature, jnp.asarray(batch.top_p), jnp.asarray(batch.top_k)
        )
        dist = jnp.where(greedy[:, None], logits, dist)
        scale = jnp.ones_like(temperature)  # already applied by filtered_logits
    else:
        dist = logits
        scale = jnp.where(greedy, 1.0, temperature)  # divisor of the logits; greedy rows keep the model's
    block = cdf_block_size(vocab)
    if vocab % block:
        dist = jnp.pad(dist, ((0, 0), (0, -vocab % block)), constant_values=-jnp.inf)
    x = dist.reshape(rows, -1, block)  # [rows, num_blocks, block]

    block_max = x.max(axis=-1) / scale[:, None]  # [rows, num_blocks]; a positive divisor commutes with max
    peak = block_max.max(axis=-1)  # [rows]
    block_sums = jnp.exp(x / scale[:, None, None] - peak[:, None, None]).sum(axis=-1)
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    # The normaliser from a pairwise sum (as accurate as a softmax's); the draw searches
    # the CDF up to its own end, whatever the rounding of either.
    log_norm = peak + jnp.log(block_sums.sum(axis=-1))  # [rows]

    keys = jax.vmap(row_key)(
        jnp.asarray(batch.seed), jnp.asarray(batch.sample_index), jnp.asarray(batch.step)
    )
    bits = jax.vmap(lambda key: jax.random.bits(key, (2, 2), jnp.uint32))(keys)  # [rows, 2, 2]
    # Two stages, each an exact inverse CDF: the block from the block sums, then the entry from
    # the chosen block's own CDF with a second uniform, so that inside a block the resolution
    # is relative to the block's mass, not the whole vocabulary's.
    chosen, _ = _pick_block(block_sums, block_cdf, fine_uniform(bits[:, 0]) * block_cdf[:, -1])
    chosen_x = jnp.take_along_axis(x, chosen[:, None, None], axis=1)[:, 0]  # [rows, block]
    weights = jnp.exp(chosen_x / scale[:, None] - peak[:, None])
    own_cdf = jnp.cumsum(weights, axis=-1)
    in_block = _first_above(weights, own_cdf, fine_uniform(bits[:, 1]) * own_cdf[:, -1])
    drawn = chosen * block + in_block
    # Greedy: the first maximum, found through the block maxima (a flat argmax is slow on CPU).
    best_block = jnp.argmax(block_max, axis=-1)
    best_x = jnp.take_along_axis(x, best_block[:, None, None], axis=1)[:, 0]
    argmax = best_block * block + jnp.argmax(best_x, axis=-1)
    tokens = jnp.where(greedy, argmax, drawn).astype(jnp.int32)

    if aligned:
        logprobs, _ = token_logprobs_from_logits(dist / scale[:, None], tokens)
    else:
        logprobs = jnp.take_along_axis(dist, tokens[:, None], axis=1)[:, 0] / scale - log_norm
    if num_top:
        # The runner rounds num_top up to a compile bucket, which can pass a small vocabulary:
        # the entries past it are padded (logprob -inf) and never reach a request.
        k = min(num_top, vocab)
        top_values, top_ids = jax.lax.top_k(dist[:, :vocab], k)
        top_logprobs = top_values / scale[:, None] - log_norm[:, None]
        if k < num_top:
            pad = ((0, 0), (0, num_top - k))
            top_ids = jnp.pad(top_ids, pad)
            top_logprobs = jnp.pad(top_logprobs, pad, constant_values=-jnp.inf)
    else:
        top_ids, top_logprobs = jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0), jnp.float32)
    return SamplerOutput(tokens, logprobs, top_ids.astype(jnp.int32), top_logprobs)


sample_jit = jax.jit(sample, static_argnames=("use_filters", "num_top", "aligned"))
