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

from rlax_model.layers import ordered_sum


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
) -> jax.Array:
    """Masked multi-head attention with grouped-query heads, softmax in float32.

    q: [batch, seq_q, num_heads, head_dim]; k, v: [batch, seq_k, num_kv_heads, head_dim];
    mask: broadcastable to [batch, num_heads, seq_q, seq_k] bool. Scores, softmax and the
    weighted sum of V are float32.
    Returns [batch, seq_q, num_heads, head_dim] in q.dtype. A query with no visible key
    gets the mean of v instead of NaN (its output is padding and must stay finite).

    key_block: None (two matmuls over all the keys), or batch-invariant attention
    (`blocked_attention`): a query's output then depends only on its visible keys and
    their places in the key axis's blocks of `key_block` (index modulo the block), not on
    how many keys, queries or rows there are.
    """
    b, sq, nh, _ = q.shape
    mask = jnp.broadcast_to(mask, (b, nh, sq, k.shape[1]))
    if key_block is not None:
        return blocked_attention(q, k, v, mask, key_block)
    d = q.shape[-1]
    nkv = k.shape[2]
    qg = q.reshape(b, sq, nkv, nh // nkv, d)
    scores = jnp.einsum("bqkgd,bckd->bkgqc", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / float(d) ** 0.5)
    # A large finite negative (not -inf) keeps fully masked rows finite.
    scores = jnp.where(mask.reshape(scores.shape), scores, jnp.float32(-1e30))
    # The max is exact in any order; stop_gradient as in jax.nn.softmax (it cancels).
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    weights = jnp.exp(scores - top)  # masked keys: exactly 0
    # float32 weights times float32 values (V upcast exactly), as the engine's decode
    # kernels compute: rounding the weights to a 16-bit V dtype would misalign them. The
    # softmax's denominator is the same product's extra column of ones.
    v1 = jnp.concatenate([v.astype(jnp.float32), jnp.ones((*v.shape[:-1], 1), jnp.float32)], axis=-1)
    acc = jnp.einsum("bkgqc,bckd->bqkgd", weights, v1, preferred_element_type=jnp.float32)
    out = acc[..., :d] / acc[..., d:]
    return out.reshape(b, sq, nh, d).astype(q.dtype)


# Elements of the largest product `blocked_attention` holds at once ([rows, heads, queries,
# keys, head_dim] float32 for one chunk of queries): 64 MiB.
BLOCKED_PRODUCT_ELEMENTS = 1 << 24


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, key_block: int) -> jax.Array:
    """Batch-invariant attention: `dense_attention_reference(key_block=...)`'s computation.

    q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_k, kv_heads, head_dim]; mask:
    [batch, heads, seq_q, seq_k] bool. Returns [batch, seq_q, heads, head_dim] in q.dtype.

    A query's output must have the same bits whatever else is in the batch: the engine's
    decode (one query), its prefill chunks and the trainer's padded or packed rows all
    compute it. XLA:CPU's matmuls cannot give that: it picks a kernel, and so the rounding,
    by the whole operand shapes (a query's scores moved by 2.9e-6 between 40 and 64 keys),
    and it lays a query out along the matmul's columns, whose rounding on an AVX2 CPU
    depends on the column's place (measured 2026-12-03: every one of 11 shifted places
    differed). So no matmul: a score is an `ordered_sum` of q times k over head_dim, and
    the weights times values are summed within each block of `key_block` keys by an
    `ordered_sum` (fixed order, elementwise adds that XLA never reassociates), then the
    blocks' sums are added one after another in key order (a block none of the query's
    keys is in adds exact zeros), in a loop. The softmax's denominator is the same sum over an extra
    column of ones. Queries go through in chunks (a loop) that bound the product's memory
    (`BLOCKED_PRODUCT_ELEMENTS`); the chunking changes no bits. Slower than the matmuls (an
    elementwise product instead of a matmul): it is for the aligned mode only.
    """
    b, sq, nh, d = q.shape
    nkv = k.shape[2]
    group = nh // nkv
    nblk = -(-k.shape[1] // key_block)
    sk = nblk * key_block
    keys = jnp.pad(k, ((0, 0), (0, sk - k.shape[1]), (0, 0), (0, 0))).astype(jnp.float32)
    keys = keys.reshape(b, nblk, key_block, nkv, d).transpose(0, 3, 1, 2, 4)  # [b, kv, blk, c, d]
    v1 = jnp.concatenate([v.astype(jnp.float32), jnp.ones((*v.shape[:-1], 1), jnp.float32)], axis=-1)
    v1 = jnp.pad(v1, ((0, 0), (0, sk - v.shape[1]), (0, 0), (0, 0)))
    v1 = v1.reshape(b, nblk, key_block, nkv, d + 1).transpose(0, 3, 1, 4, 2)  # [b, kv, blk, d+1, c]
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, sk - mask.shape[-1])))
    chunk = max(1, min(sq, BLOCKED_PRODUCT_ELEMENTS // max(1, b * nh * sk * (d + 1))))
    count = -(-sq // chunk)
    queries = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, count * chunk - sq), (0, 0), (0, 0)))
    queries = queries.reshape(b, count, chunk, nkv, group, d).transpose(1, 0, 3, 4, 2, 5)
    masks = jnp.pad(mask, ((0, 0), (0, 0), (0, count * chunk - sq), (0, 0)))
    masks = masks.reshape(b, nkv, group, count, chunk, nblk, key_block).transpose(3, 0, 1, 2, 4, 5, 6)
    scale = jnp.float32(1.0 / float(d) ** 0.5)

    def attend(part: tuple[jax.Array, jax.Array]) -> jax.Array:
        qc, visible = part  # [b, kv, g, chunk, d], [b, kv, g, chunk, blk, c]
        products = qc[:, :, :, :, None, None, :] * keys[:, :, None, None]  # [b, kv, g, q, blk, c, d]
        scores = ordered_sum(products)[..., 0] * scale  # [b, kv, g, q, blk, c]
        # A large finite negative (not -inf) keeps fully masked rows finite.
        scores = jnp.where(visible, scores, jnp.float32(-1e30))
        # The max is exact in any order; stop_gradient as in jax.nn.softmax (it cancels).
        top = jax.lax.stop_gradient(jnp.max(scores, axis=(-2, -1), keepdims=True))
        weights = jnp.exp(scores - top)  # masked keys: exactly 0
        # float32 weights times float32 values (V upcast exactly): rounding the weights to
        # a 16-bit V dtype would misalign them from the engine's.
        sums = ordered_sum(weights[..., None, :] * v1[:, :, None, None])[..., 0]  # [b, kv, g, q, blk, d+1]
        # The blocks' sums one after another, in key order, as a loop: XLA rewrote a chain
        # of 15 adds of slices into a reduction of its own order (measured: a query's output
        # moved between 128 and 256 keys).
        acc: jax.Array
        acc, _ = jax.lax.scan(
            lambda total, block: (total + block, None), sums[..., 0, :], jnp.moveaxis(sums[..., 1:, :], -2, 0)
        )
        return acc[..., :d] / acc[..., d:]  # [b, kv, g, q, d]

    out: jax.Array = jax.lax.map(attend, (queries, masks))  # [count, b, kv, g, chunk, d]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, count * chunk, nh, d)[:, :sq]
    return out.astype(q.dtype)


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
