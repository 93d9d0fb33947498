"""The attention seam: the `AttentionFn` protocol and the default dense causal attention.

`forward` calls the attention function once per layer, inside `jax.lax.scan`, as

    out, new_layer_cache = attention(q, k, v, layer_cache, attention_context)

    q:               [batch, seq, num_heads, head_dim]     (compute dtype, RoPE applied)
    k, v:            [batch, seq, num_kv_heads, head_dim]  (compute dtype, RoPE applied to k)
    layer_cache:     this layer's slice of `forward(kv_cache=...)`: any pytree whose leaves
                     had a leading [num_layers] axis, with that axis removed; or None
    attention_context: one pytree shared by every layer (masks, lengths, block tables...)
    out:             [batch, seq, num_heads, head_dim]     (compute dtype)
    new_layer_cache: same structure as `layer_cache` (or None); stacked back to
                     [num_layers, ...] as `forward`'s second result.

An implementation owns softmax scaling (1/sqrt(head_dim)), grouped-query head sharing
(query head h reads kv head h // (num_heads // num_kv_heads)), masking and its cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from rlax_model.layers import ALIGNED_MIN_ROWS, MIN_MATMUL_ROWS


class AttentionFn(Protocol):
    """A per-layer attention function; see the module docstring for the shapes."""

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        layer_cache: Any,
        attention_context: Any,
        /,
    ) -> tuple[jax.Array, Any]: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseContext:
    """Context of `dense_causal_attention`.

    valid: [batch, seq] bool, True where the token is real (not padding). Left and right
    padding both work: a query attends to the valid keys at the same or earlier index.
    """

    valid: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedContext:
    """Context of `dense_causal_attention` for rows that pack several sequences.

    segment: [batch, seq] int32, 0 on padding, else the id of the segment the token is in;
    parent: [batch, seq] int32, the segment a token may also attend to (a shared prefix
    placed earlier in the row; a prefix's own id for its tokens); positions: [batch, seq]
    int32, the tokens' positions in their sequences (for a sliding window). A query attends
    to the keys at the same or an earlier index of its own segment or of its parent.
    """

    segment: jax.Array
    parent: jax.Array
    positions: jax.Array


def packed_mask(ctx: PackedContext, sliding_window: int | None = None) -> jax.Array:
    """PackedContext -> [batch, 1, seq_q, seq_k] bool (see `PackedContext`)."""
    seq = ctx.segment.shape[-1]
    idx = jnp.arange(seq)
    seg_k = ctx.segment[:, None, :]
    mask = (
        (idx[None, None, :] <= idx[None, :, None])
        & (seg_k != 0)
        & ((seg_k == ctx.segment[:, :, None]) | (seg_k == ctx.parent[:, :, None]))
    )
    if sliding_window is not None:
        mask &= ctx.positions[:, :, None] - ctx.positions[:, None, :] < sliding_window
    return mask[:, None]


def positions_from_valid(valid: jax.Array) -> jax.Array:
    """Positions that count only valid tokens: [batch, seq] bool -> [batch, seq] int32.

    The first valid token of each row gets position 0; padding gets the position of the
    nearest valid token before it (0 before the first one), which is harmless because
    padding is masked out.
    """
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def causal_valid_mask(valid: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """[batch, seq] bool -> [batch, 1, seq_q, seq_k] bool: key valid and key index <= query index
    (and query index - key index < sliding_window when a window is given)."""
    seq = valid.shape[-1]
    idx = jnp.arange(seq)
    causal = idx[None, :] <= idx[:, None]
    if sliding_window is not None:
        causal = causal & (idx[:, None] - idx[None, :] < sliding_window)
    return causal[None, None, :, :] & valid[:, None, None, :]


# The key block of batch-invariant attention (`dense_attention_reference(key_block=...)`);
# `rlax_trainer.packing` aligns segments to it when it packs batch-invariantly.
KEY_BLOCK = 16


def dense_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    key_block: int | None = None,
    batched_blocks: bool = False,
) -> jax.Array:
    """Masked multi-head attention with grouped-query heads, softmax in float32.

    q: [batch, seq_q, num_heads, head_dim]; k, v: [batch, seq_k, num_kv_heads, head_dim];
    mask: broadcastable to [batch, num_heads, seq_q, seq_k] bool. Scores, softmax and the
    weighted sum of V are float32.
    Returns [batch, seq_q, num_heads, head_dim] in q.dtype. A query with no visible key
    gets the mean of v instead of NaN (its output is padding and must stay finite).

    key_block: None (one matmul over all the keys), or batch-invariant attention: a query's
    output then depends only on its visible keys and their places in the key axis's blocks
    of `key_block` (index modulo the block), not on how many keys, queries or rows there
    are. XLA:CPU picks a matmul's kernel, and so its rounding, by the whole operand shapes
    (measured: a query's scores moved by 2.9e-6 between 40 and 64 keys; a 100-token
    sequence's outputs by 3.6e-7 between 103 and 256 keys), so the scores and the weights
    times values run as one matmul per block of exactly `key_block` keys (the key axis
    zero-padded to a multiple of it), the blocks' partial sums are added in key order, and
    fewer than `layers.MIN_MATMUL_ROWS` query rows are padded to it (except one query:
    decoding, padded only to `layers.ALIGNED_MIN_ROWS` matmul rows when the model has one
    query head per KV head). Bitwise agreement between programs of different query counts
    (the engine's decode and prefill against the trainer's pass) also needs
    `layers.ALIGNED_COMPILER_OPTIONS`: XLA:CPU's default matmul rounds by the query count.
    Its cost: the update's temporary memory 107 -> 343 MB on 512-token packed
    rows of a 2-layer SmolLM2-wide model (the per-block matmuls' operands and partial sums).
    batched_blocks (with key_block): the per-block matmuls as one matmul batched over the
    blocks, the same products and the same key-order sum of the blocks' partial sums: for
    the engine's decode (one query, no gradient), where the unrolled matmuls' overhead
    dominates; with `layers.ALIGNED_COMPILER_OPTIONS` it gives the unrolled form's bits.
    """
    b, sq, nh, d = q.shape
    nkv = k.shape[2]
    group = nh // nkv
    mask = jnp.broadcast_to(mask, (b, nh, sq, k.shape[1]))
    block = key_block or k.shape[1]
    small = key_block is not None and 1 < sq and sq * group < MIN_MATMUL_ROWS
    rows = -(-MIN_MATMUL_ROWS // group) if small else sq
    if key_block is not None and rows * group < ALIGNED_MIN_ROWS:  # one decoded query, one head per KV head
        rows = -(-ALIGNED_MIN_ROWS // group)
    nblk = -(-k.shape[1] // block)
    sk = nblk * block
    q = jnp.pad(q, ((0, 0), (0, rows - sq), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, sk - k.shape[1]), (0, 0), (0, 0))).reshape(b, nblk, block, nkv, d)
    v = jnp.pad(v, ((0, 0), (0, sk - v.shape[1]), (0, 0), (0, 0)))
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, rows - sq), (0, sk - mask.shape[-1])))
    # One matmul per key block ([queries, head_dim] x [head_dim, block]), unrolled: a
    # batched matmul over the blocks would need the queries broadcast over them (and saved
    # for the backward pass: 12x the update's temporary memory on 512-token rows).
    qg = q.reshape(b, rows, nkv, group, d)
    if batched_blocks:
        scores = jnp.einsum("bqkgd,bnckd->bkgqnc", qg, k, preferred_element_type=jnp.float32)
        scores = scores.reshape(b, nkv, group, rows, sk) * (1.0 / float(d) ** 0.5)
    else:
        blocks = [
            jnp.einsum("bqkgd,bckd->bkgqc", qg, k[:, i], preferred_element_type=jnp.float32)
            for i in range(nblk)
        ]
        scores = jnp.concatenate(blocks, axis=-1) * (1.0 / float(d) ** 0.5)
    # A large finite negative (not -inf) keeps fully masked rows finite.
    scores = jnp.where(mask.reshape(b, nkv, group, rows, sk), scores, jnp.float32(-1e30))
    # The max is exact in any order; stop_gradient as in jax.nn.softmax (it cancels).
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    weights = jnp.exp(scores - top)  # masked keys: exactly 0
    # float32 weights times float32 values (V upcast exactly), as the engine's decode
    # kernels compute: rounding the weights to a 16-bit V dtype would misalign them. The
    # softmax's denominator is the same product's extra column of ones: the same reduction
    # over the keys for both (a `sum` over the keys is ordered by XLA from the whole length,
    # and a sequence's denominator moved with its padding and its packed neighbours).
    v1 = jnp.concatenate([v.astype(jnp.float32), jnp.ones((*v.shape[:-1], 1), jnp.float32)], axis=-1)
    weights = weights.reshape(b, nkv, group, rows, nblk, block)
    v1 = v1.reshape(b, nblk, block, nkv, d + 1)
    if batched_blocks:
        parts = jnp.einsum("bkgqnc,bnckd->nbqkgd", weights, v1, preferred_element_type=jnp.float32)

    def part(i: int) -> jax.Array:
        if batched_blocks:
            return parts[i]
        return jnp.einsum(
            "bkgqc,bckd->bqkgd", weights[..., i, :], v1[:, i], preferred_element_type=jnp.float32
        )

    acc = part(0)
    for i in range(1, nblk):  # in key order; a block no key of the query is in adds zeros
        acc = acc + part(i)
    out = acc[:, :sq, ..., :d] / acc[:, :sq, ..., d:]
    return out.reshape(b, sq, nh, d).astype(q.dtype)


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer_cache: Any,
    attention_context: Any,
    *,
    sliding_window: int | None = None,
    key_block: int | None = None,
) -> tuple[jax.Array, None]:
    """Default `AttentionFn`: causal attention over the current sequence, no KV cache.

    attention_context: a `DenseContext` (padding mask), a `PackedContext` (packed
    sequences) or None (every token valid).
    sliding_window: `forward` binds `config.sliding_window` here. key_block: see
    `dense_attention_reference` (batch-invariant attention; None: one matmul).
    layer_cache must be None. Returns (out [batch, seq, num_heads, head_dim], None).
    """
    if layer_cache is not None:
        raise ValueError(
            "dense_causal_attention keeps no KV cache; pass kv_cache=None or an attention "
            "function that manages a cache"
        )
    b, s = q.shape[:2]
    if isinstance(attention_context, PackedContext):
        if attention_context.segment.shape != (b, s):
            raise ValueError(
                f"PackedContext.segment has shape {attention_context.segment.shape}, expected {(b, s)}"
            )
        mask = packed_mask(attention_context, sliding_window)
        return dense_attention_reference(q, k, v, mask, key_block=key_block), None
    if attention_context is None:
        valid = jnp.ones((b, s), dtype=bool)
    elif isinstance(attention_context, DenseContext):
        valid = attention_context.valid
        if valid.shape != (b, s):
            raise ValueError(f"DenseContext.valid has shape {valid.shape}, expected [batch, seq]={(b, s)}")
    else:
        raise TypeError(
            f"dense_causal_attention needs a DenseContext, a PackedContext or None, got {type(attention_context).__name__}"
        )
    mask = causal_valid_mask(valid, sliding_window)
    return dense_attention_reference(q, k, v, mask, key_block=key_block), None
