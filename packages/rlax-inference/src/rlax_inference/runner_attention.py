"""The model runner's attention over the paged KV cache, one function per kind of step.

Each reads the whole (read-only) cache in place through its layer index and block tables,
adds the step's own tokens to the softmax itself, and hands their new K/V out of the layer
scan; `write_all_layers` then writes every layer's into the donated cache at once (see
`rlax_inference.model_runner`). Prefill: a chunk of each row's prompt against the row's
cached tokens and causally to itself; decode: one token per row, through the CPU/XLA paths
or a Pallas kernel of `rlax_kernels`; the aligned variants compute as the trainer's
batch-invariant pass does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import rlax_kernels
from rlax_model import dense_attention_reference
from rlax_model.attention import KEY_BLOCK

__all__ = [
    "PREFILL_PAGES_PER_STEP",
    "FusedDecodeContext",
    "KVCache",
    "PrefillContext",
    "aligned_prefill_attention",
    "decode_attend",
    "make_aligned_decode_attention",
    "MixedContext",
    "make_fused_decode_attention",
    "make_mixed_attention",
    "prefill_attention",
    "write_all_layers",
]

KVCache = dict[str, jax.Array]


class PrefillContext(NamedTuple):
    cache: KVCache  # the whole cache, read only: [layers, kv_heads, pages, page_size, head_dim]
    starts: jax.Array  # [rows] int32, tokens already in the cache (the chunk's first position)
    lengths: jax.Array  # [rows] int32, the chunk's tokens (the rest of the row is padding)
    block_tables: jax.Array  # [rows, width] int32, covering the first `starts` tokens
    sliding_window: int | None  # ModelConfig.sliding_window (static)


class FusedDecodeContext(NamedTuple):
    cache: KVCache  # the whole cache, read only: [layers, kv_heads, pages, page_size, head_dim]
    lengths: jax.Array  # [batch] int32, tokens including the current one (not yet in the cache)
    block_tables: jax.Array  # [batch, width] int32


class MixedContext(NamedTuple):
    """A mixed step's two parts: `decode.lengths.shape[0]` decode tokens first, then the
    prefill chunks' `[rows, chunk]` tokens, all in one packed row (`make_mixed_attention`)."""

    decode: FusedDecodeContext
    prefill: PrefillContext


def write_all_layers(cache: KVCache, new_k: jax.Array, new_v: jax.Array, slots: jax.Array) -> KVCache:
    """Scatter every layer's new K/V `[layers, tokens, kv_heads, head_dim]` into `slots` `[tokens]`.

    One scatter per tensor over all layers, in place when the caller donates the cache; slot
    -1 (padding) is dropped, as in `rlax_kernels.write_kv`.
    """
    out = {}
    for name, new in (("k", new_k), ("v", new_v)):
        pages = cache[name]
        num_pages, page_size = pages.shape[2], pages.shape[3]
        page = jnp.where(slots >= 0, slots // page_size, num_pages)
        offset = jnp.where(slots >= 0, slots % page_size, 0)
        rows = new.astype(pages.dtype).transpose(0, 2, 1, 3)  # [layers, kv_heads, tokens, head_dim]
        out[name] = pages.at[:, :, page, offset].set(rows, mode="drop")
    return out


# Pages of context one iteration of `prefill_attention`'s loop reads (64 keys at 16 per page).
PREFILL_PAGES_PER_STEP = 4


def prefill_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array, ctx: PrefillContext
) -> tuple[jax.Array, KVCache]:
    """A chunk of each row's prompt attends to the row's cached tokens and causally to itself.

    q: [rows, chunk, heads, head_dim]; k, v: [rows, chunk, kv_heads, head_dim]; layer: int32
    scalar; ctx.block_tables: [rows, width] with width a multiple of `PREFILL_PAGES_PER_STEP`
    (the runner passes the longest table a sequence can have, so the table's width never
    selects a program). The chunk's own keys come first; then a loop whose trip count is
    computed on the device reads `PREFILL_PAGES_PER_STEP` pages of this layer's cache per
    iteration, only as many as the longest row's cached prefix needs, and folds them into
    an online float32 softmax (flash attention's running max and sum). So a prompt fed in
    chunks gives the logits of a prompt fed at once up to float32 rounding, a fresh prompt
    reads no cache at all, and the cost follows the cached tokens, not the table's width.
    The chunk's K/V leave the scan, to be written after it.
    """
    rows, chunk, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    page_size = ctx.cache["k"].shape[3]
    per_step = PREFILL_PAGES_PER_STEP
    width = ctx.block_tables.shape[1]
    if width % per_step:
        raise ValueError(f"prefill block tables are {width} wide, not a multiple of {per_step}")
    scale = 1.0 / float(head_dim) ** 0.5
    qg = q.reshape(rows, chunk, kv_heads, group, head_dim)
    q_pos = ctx.starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [rows, chunk]

    def fold(
        state: tuple[jax.Array, jax.Array, jax.Array], keys: jax.Array, values: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Fold keys/values [rows, n, kv_heads, head_dim] with `visible` [rows, chunk, n] into
        the running (max [rows, kv, group, chunk], sum, weighted values [..., head_dim])."""
        top, total, acc = state
        scores = jnp.einsum("bqkgd,bckd->bkgqc", qg, keys, preferred_element_type=jnp.float32) * scale
        visible = visible[:, None, None]
        new_top = jnp.maximum(top, jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1))
        weights = jnp.where(visible, jnp.exp(scores - new_top[..., None]), 0.0)
        rescale = jnp.exp(top - new_top)  # both -inf only where nothing is visible yet: 0 below
        rescale = jnp.where(jnp.isfinite(new_top), rescale, 0.0)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "bkgqc,bckd->bkgqd", weights, values.astype(jnp.float32), preferred_element_type=jnp.float32
        )
        return new_top, total, acc

    own = jnp.arange(chunk, dtype=jnp.int32)
    visible = (own[None, None, :] <= own[None, :, None]) & (own[None, None, :] < ctx.lengths[:, None, None])
    if ctx.sliding_window is not None:
        visible &= own[None, :, None] - own[None, None, :] < ctx.sliding_window
    state = (
        jnp.full((rows, kv_heads, group, chunk), -jnp.inf, jnp.float32),
        jnp.zeros((rows, kv_heads, group, chunk), jnp.float32),
        jnp.zeros((rows, kv_heads, group, chunk, head_dim), jnp.float32),
    )
    state = fold(state, k, v, visible)

    span = per_step * page_size

    def cached_step(step: jax.Array, state: tuple[jax.Array, jax.Array, jax.Array]) -> Any:
        tables = jax.lax.dynamic_slice_in_dim(ctx.block_tables, step * per_step, per_step, axis=1)
        key_pos = step * span + jnp.arange(span, dtype=jnp.int32)  # [span]
        seen = jnp.broadcast_to((key_pos[None, :] < ctx.starts[:, None])[:, None, :], (rows, chunk, span))
        if ctx.sliding_window is not None:
            seen &= q_pos[:, :, None] - key_pos[None, None, :] < ctx.sliding_window
        keys = _layer_pages(ctx.cache["k"], layer, tables).astype(k.dtype)
        return fold(state, keys, _layer_pages(ctx.cache["v"], layer, tables).astype(v.dtype), seen)

    steps = (jnp.max(ctx.starts) + span - 1) // span
    top, total, acc = jax.lax.fori_loop(0, steps, cached_step, state)
    out = acc / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]  # padding queries: 0
    out = out.transpose(0, 3, 1, 2, 4).reshape(rows, chunk, heads, head_dim)
    return out.astype(q.dtype), {"k": k, "v": v}


def _layer_pages(pages: jax.Array, layer: jax.Array, tables: jax.Array) -> jax.Array:
    """Layer `layer`'s pages of `tables` [rows, width], in table order:
    [rows, width * page_size, kv_heads, head_dim] in the cache's dtype.

    Whole pages as rows of one flat table: XLA:CPU copies each as one contiguous slice
    (indexing the 5-D cache with the tables took 22 ms instead of 14 ms for 30 layers of
    8 rows x 8 pages, measured on a loaded CPU).
    """
    rows, width = tables.shape
    layers, kv_heads, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(layers * kv_heads * num_pages, page_size * head_dim)
    heads = (layer * kv_heads + jnp.arange(kv_heads, dtype=jnp.int32)) * num_pages  # [kv_heads]
    got = jnp.take(flat, heads[None, :, None] + tables[:, None, :], axis=0, mode="clip")
    return got.reshape(rows, kv_heads, width * page_size, head_dim).transpose(0, 2, 1, 3)


def _positioned(
    pages: jax.Array, layer: jax.Array, tables: jax.Array, new: jax.Array, starts: jax.Array
) -> jax.Array:
    """A row's cached tokens and its new ones, each at the index of its position.

    pages: one 5-D cache tensor; tables: [rows, width]; new: [rows, n, kv_heads, head_dim],
    the tokens at positions starts..starts+n-1. Returns [rows, width * page_size + n,
    kv_heads, head_dim] in new.dtype: index i < starts holds cached position i, starts <= i
    < starts + n the new tokens, the rest whatever the pages or the new tokens hold there
    (the caller masks it).
    """
    n = new.shape[1]
    width, page_size = tables.shape[1], pages.shape[3]
    got = _layer_pages(pages, layer, tables).astype(new.dtype)
    got = jnp.pad(got, ((0, 0), (0, n), (0, 0), (0, 0)))
    rel = jnp.arange(width * page_size + n, dtype=jnp.int32)[None, :] - starts[:, None]  # [rows, keys]
    if n == 1:  # decode: a broadcast, not a gather
        fresh = new
    else:
        fresh = jnp.take_along_axis(new, jnp.clip(rel, 0, n - 1)[:, :, None, None], axis=1)
    return jnp.where(((rel >= 0) & (rel < n))[:, :, None, None], fresh, got)


def aligned_prefill_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array, ctx: PrefillContext
) -> tuple[jax.Array, KVCache]:
    """`prefill_attention` as the trainer's batch-invariant pass computes it.

    Every key sits at the index of its position (cached tokens first, then the chunk) and
    the attention is `dense_attention_reference(key_block=KEY_BLOCK)`, the trainer's under
    `trainer.batch_invariant`: a query's output depends only on its visible keys and their
    positions, so (with `ALIGNED_COMPILER_OPTIONS`) it is bitwise the trainer's for the
    same tokens, whatever the chunking, padding or batch.
    """
    chunk = q.shape[1]
    keys = _positioned(ctx.cache["k"], layer, ctx.block_tables, k, ctx.starts)
    values = _positioned(ctx.cache["v"], layer, ctx.block_tables, v, ctx.starts)
    q_pos = ctx.starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [rows, chunk]
    key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, None, :]
    mask = (key_pos <= q_pos[:, :, None]) & (key_pos < (ctx.starts + ctx.lengths)[:, None, None])
    if ctx.sliding_window is not None:
        mask &= q_pos[:, :, None] - key_pos < ctx.sliding_window
    out = dense_attention_reference(q, keys, values, mask[:, None], key_block=KEY_BLOCK)
    return out, {"k": k, "v": v}


def make_aligned_decode_attention(sliding_window: int | None) -> Callable[..., Any]:
    """Decode attention as the trainer's batch-invariant pass computes it (see
    `aligned_prefill_attention`): the cached pages gathered through the block tables, the
    current token at its position, `dense_attention_reference(key_block=KEY_BLOCK)`.
    Slower than the decode kernels (XLA gathers every page of the table width)."""

    def attention(
        q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array, ctx: FusedDecodeContext
    ) -> tuple[jax.Array, KVCache]:
        current = ctx.lengths - 1  # [batch] the token's position
        keys = _positioned(ctx.cache["k"], layer, ctx.block_tables, k, current)
        values = _positioned(ctx.cache["v"], layer, ctx.block_tables, v, current)
        key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :]
        mask = key_pos <= current[:, None]
        if sliding_window is not None:
            mask &= current[:, None] - key_pos < sliding_window
        out = dense_attention_reference(q, keys, values, mask[:, None, None, :], key_block=KEY_BLOCK)
        return out, {"k": k[:, 0], "v": v[:, 0]}

    return attention


def decode_attend(backend: str, interpret: bool) -> Callable[..., jax.Array]:
    """The decode attention of `backend`: `paged_attention_cpu`/`_xla` or the Pallas kernel of
    `rlax_kernels.paged_attention`; each takes the 5-D cache, a layer index and the new K/V."""
    if backend == "cpu":
        return rlax_kernels.paged_attention_cpu
    if backend == "xla":
        return rlax_kernels.paged_attention_xla
    return functools.partial(rlax_kernels.paged_attention, backend=backend, interpret=interpret)  # type: ignore[arg-type]


def make_fused_decode_attention(
    attend: Callable[..., jax.Array], sliding_window: int | None
) -> Callable[..., Any]:
    """Decode attention: cached tokens (read in place through the block tables) plus the current token.

    The current token's K/V join the softmax directly (`attend` is `decode_attend`'s: the
    CPU/XLA paths or a Pallas kernel, which reads layer `layer` of the 5-D cache through a
    scalar-prefetched index) and leave as this layer's output, to be written into the cache
    once after the layer scan. Threading the cache through the scan instead would copy all
    of it every step (measured: 1.5-2.1x the cache in temporaries with the Pallas kernels).
    """

    def attention(
        q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array, ctx: FusedDecodeContext
    ) -> tuple[jax.Array, KVCache]:
        """q: [batch, 1, heads, head_dim]; k, v: [batch, 1, kv_heads, head_dim]; layer: int32 scalar."""
        out = attend(
            q[:, 0],
            ctx.cache["k"],
            ctx.cache["v"],
            ctx.lengths - 1,
            ctx.block_tables,
            new_k=k[:, 0],
            new_v=v[:, 0],
            layer=layer,
            sliding_window=sliding_window,
        )
        return out[:, None], {"k": k[:, 0], "v": v[:, 0]}

    return attention


def make_mixed_attention(attend: Callable[..., jax.Array], sliding_window: int | None) -> Callable[..., Any]:
    """Attention of a mixed step: decode tokens and prefill chunks packed into one row.

    The model's dense work (projections, MLP) runs once over all the step's tokens -- one
    pass over the weights instead of one per call, which is what a decode step is bound by
    -- and only attention tells the parts apart: the first `R = ctx.decode.lengths.shape[0]`
    tokens are one decode token per sequence (`make_fused_decode_attention`), the rest are
    `ctx.prefill`'s `[rows, chunk]` chunks (`prefill_attention`). No token of one part sees
    the other: they belong to different sequences, and a step's K/V are written after it.
    q: [1, R + rows * chunk, heads, head_dim]; k, v: [1, R + rows * chunk, kv_heads, head_dim].
    """
    decode = make_fused_decode_attention(attend, sliding_window)

    def attention(
        q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array, ctx: MixedContext
    ) -> tuple[jax.Array, KVCache]:
        num_decode = ctx.decode.lengths.shape[0]
        rows, chunk = ctx.prefill.lengths.shape[0], (q.shape[1] - num_decode) // ctx.prefill.lengths.shape[0]

        def prefill_part(x: jax.Array) -> jax.Array:
            return x[0, num_decode:].reshape(rows, chunk, *x.shape[2:])

        dec_out, _ = decode(
            q[0, :num_decode, None], k[0, :num_decode, None], v[0, :num_decode, None], layer, ctx.decode
        )
        pre_out, _ = prefill_attention(prefill_part(q), prefill_part(k), prefill_part(v), layer, ctx.prefill)
        out = jnp.concatenate([dec_out[:, 0], pre_out.reshape(rows * chunk, *pre_out.shape[2:])])
        return out[None], {"k": k[0], "v": v[0]}

    return attention
