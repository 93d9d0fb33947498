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


class AttentionFn(Protocol):
    """A per-layer attention function; see the module docstring for the shapes."""

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        layer_cache: Any,
        attention_context: Any,
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


def dense_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked multi-head attention with grouped-query heads, softmax in float32.

    q: [batch, seq_q, num_heads, head_dim]; k, v: [batch, seq_k, num_kv_heads, head_dim];
    mask: broadcastable to [batch, num_heads, seq_q, seq_k] bool. Scores, softmax and the
    weighted sum of V are float32.
    Returns [batch, seq_q, num_heads, head_dim] in q.dtype. A query with no visible key
    gets the mean of v instead of NaN (its output is padding and must stay finite).
    """
    b, sq, nh, d = q.shape
    nkv = k.shape[2]
    group = nh // nkv
    qg = q.reshape(b, sq, nkv, group, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / float(d) ** 0.5)
    mask = jnp.broadcast_to(mask, (b, nh, sq, k.shape[1])).reshape(b, nkv, group, sq, k.shape[1])
    # A large finite negative (not -inf) keeps fully masked rows finite.
    scores = jnp.where(mask, scores, jnp.float32(-1e30))
    probs = jax.nn.softmax(scores, axis=-1)
    # float32 probabilities times float32 values (V upcast exactly), as the engine's decode
    # kernels compute: rounding the probabilities to a 16-bit V dtype would misalign them.
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v.astype(jnp.float32), preferred_element_type=jnp.float32)
    return out.reshape(b, sq, nh, d).astype(q.dtype)


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer_cache: Any,
    attention_context: Any,
    *,
    sliding_window: int | None = None,
) -> tuple[jax.Array, None]:
    """Default `AttentionFn`: causal attention over the current sequence, no KV cache.

    attention_context: a `DenseContext` (padding mask), a `PackedContext` (packed
    sequences) or None (every token valid).
    sliding_window: `forward` binds `config.sliding_window` here.
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
        return dense_attention_reference(q, k, v, packed_mask(attention_context, sliding_window)), None
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
    return dense_attention_reference(q, k, v, causal_valid_mask(valid, sliding_window)), None
