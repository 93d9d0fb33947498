"""Pallas GPU (Triton lowering) kernel for attention over a paged KV cache (decode and prefill).

Queries arrive as *rows* grouped by KV head (``[batch, num_kv_heads, rows, head_dim]``,
row ``r`` = query head ``r % group`` of chunk token ``r // group``; decode has one chunk
token). Grid ``(batch, num_kv_heads, row_blocks)``: one program per (sequence, KV head,
row block) holds its query rows as one ``[block_rows, head_dim]`` tile -- for decode, all
query heads of one KV head -- and loops over the sequence's pages, ``pages_per_block``
pages per iteration (gathered through the block table), with an online softmax in float32
registers (``online_softmax.py``, shared with the TPU kernel). The loop stops at the last
key the row block can see causally, so short sequences cost little however long the block
table is.

Triton needs power-of-two register tiles and at least 16 rows for a tensor-core dot, so
rows are zero-padded to a multiple of ``block_rows`` (a power of two >= 16) and the block
table to a multiple of the compute block; padded rows are dropped afterwards. Block-table
entries past a sequence's last page are replaced by page 0 before they are used as
addresses, and keys at or past the length are masked in both the scores and the values,
so garbage (even NaN) in unused slots never reaches the output.

Not run on GPU hardware in this repository's CI: tests run it with ``interpret=True``
(Pallas' generic interpreter on the CPU) and lower it to Triton IR for a CUDA target
without compiling it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rlax_kernels.paged_attention.online_softmax import (
    OnlineSoftmax,
    online_softmax_add_key,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_update,
)


def _kernel(
    seq_lens_ref: jax.Ref,  # [1] int32
    q_lens_ref: jax.Ref,  # [1] int32
    tables_ref: jax.Ref,  # [padded_max_pages] int32
    layer_ref: jax.Ref,  # [1] int32
    q_ref: jax.Ref,  # [block_rows, head_dim]
    k_ref: jax.Ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim]: the whole cache
    v_ref: jax.Ref,  # [num_layers * num_kv_heads * total_pages, page_size, head_dim]
    *refs: jax.Ref,  # (new_k_ref, new_v_ref: [1, head_dim], with has_new), o_ref
    group: int,
    scale: float,
    page_size: int,
    pages_per_block: int,
    exact_f32: bool,
    sliding_window: int | None,
    num_kv_heads: int,
    total_pages: int,
    has_new: bool,
) -> None:
    if has_new:
        new_k_ref, new_v_ref, o_ref = refs
    else:
        (o_ref,) = refs
    rb = pl.program_id(2)
    # This (layer, KV head)'s pages start here in the flattened cache.
    base = (layer_ref[0] * num_kv_heads + pl.program_id(1)) * total_pages
    block_rows, head_dim = q_ref.shape
    block_tokens = pages_per_block * page_size
    length = seq_lens_ref[0]
    q_len = q_lens_ref[0]
    n_pages = (length + page_size - 1) // page_size
    # Chunk tokens covered by this row block, and how far into the cache the last can see.
    first_tok = rb * block_rows // group
    last_tok = jnp.minimum(((rb + 1) * block_rows - 1) // group, q_len - 1)
    visible = length - q_len + last_tok + 1
    n_iters = jnp.where(first_tok < q_len, (visible + block_tokens - 1) // block_tokens, 0)
    row_tok = (rb * block_rows + jnp.arange(block_rows, dtype=jnp.int32)) // group
    q_pos = length - q_len + row_tok  # [block_rows]
    # With a window, keys before the first one this row block's first token sees are
    # neither read (the loop starts at their block) nor weighted.
    first_key = (
        0 if sliding_window is None else jnp.maximum(length - q_len + first_tok - sliding_window + 1, 0)
    )
    q = q_ref[...]
    precision = lax.Precision.HIGHEST if exact_f32 else None

    def body(it: jax.Array, state: OnlineSoftmax) -> OnlineSoftmax:
        first_page = it * pages_per_block
        page_ids = first_page + jnp.arange(pages_per_block, dtype=jnp.int32)
        pages = tables_ref[pl.ds(first_page, pages_per_block)]
        pages = base + jnp.where(page_ids < n_pages, pages, 0)
        k = k_ref[pages].reshape(block_tokens, head_dim)
        v = v_ref[pages].reshape(block_tokens, head_dim)
        k_pos = it * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        key_valid = (k_pos < length) & (k_pos >= first_key)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        if sliding_window is not None:
            allowed &= q_pos[:, None] - k_pos[None, :] < sliding_window
        scores = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [block_rows, block_tokens]
        scores = jnp.where(allowed, scores, -jnp.inf)
        v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
        return online_softmax_update(state, scores, v, precision=precision)

    init = online_softmax_init(block_rows, head_dim)
    state = lax.fori_loop(jnp.minimum(first_key // block_tokens, n_iters), n_iters, body, init)
    if has_new:  # the newest token, not in the cache, joins the softmax last
        s_new = jnp.sum(q.astype(jnp.float32) * new_k_ref[...].astype(jnp.float32), axis=1) * scale
        state = online_softmax_add_key(state, s_new[:, None], new_v_ref[...])
    out = online_softmax_finish(state)
    o_ref[...] = jnp.where((row_tok < q_len)[:, None], out, 0.0).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "group",
        "scale",
        "pages_per_block",
        "block_rows",
        "num_warps",
        "num_stages",
        "interpret",
        "sliding_window",
    ),
)
def paged_attention_rows_gpu(
    q_rows: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    seq_lens: jax.Array,
    q_lens: jax.Array,
    block_tables: jax.Array,
    *,
    group: int,
    scale: float,
    pages_per_block: int,
    block_rows: int,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
) -> jax.Array:
    """Run the Pallas Triton kernel on KV-head-grouped query rows (inputs already validated).

    Args:
      q_rows: ``[batch, num_kv_heads, rows, head_dim]``; ``rows`` a multiple of ``block_rows``
        (row ``r`` is query head ``r % group`` of chunk token ``r // group``); ``head_dim``
        a power of two.
      k_pages, v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``; ``page_size``
        a power of two.
      seq_lens: ``[batch] int32``, cache tokens per sequence including this chunk (>= 1).
      q_lens: ``[batch] int32``, valid chunk tokens per sequence; the rest are padding.
      block_tables: ``[batch, max_pages_per_seq] int32``.
      group: query heads per KV head.
      scale: softmax temperature.
      pages_per_block: pages gathered per loop iteration (a power of two).
      block_rows: query rows per program (a power of two, >= 16).
      num_warps, num_stages: Triton launch parameters.
      interpret: run with Pallas' generic interpreter on the CPU.
      sliding_window: when given, a query at position ``p`` sees keys ``p - sliding_window < k <= p``.
      layer: int32 scalar: ``k_pages``/``v_pages`` carry a leading layer axis
        (``[num_layers, num_kv_heads, total_pages, page_size, head_dim]``); the kernel gets the
        whole cache (a free reshape) and addresses this layer's pages itself: nothing is sliced
        or copied.
      new_k, new_v: ``[batch, num_kv_heads, head_dim]``, the newest token of each sequence
        (decode only), not in the cache: ``seq_lens`` counts the cached tokens only (>= 0,
        ``q_lens`` 1) and the token joins the softmax last; its position is ``seq_lens``, so a
        window counts it.

    Returns:
      ``[batch, num_kv_heads, rows, head_dim]`` in ``q_rows``' dtype; padding rows are zero.
    """
    batch, num_kv_heads, rows, head_dim = q_rows.shape
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    total_pages, page_size = k_pages.shape[2:4]
    # One flat page axis over (layer, KV head, page): a reshape, free for a contiguous cache.
    k_flat = k_pages.reshape(-1, page_size, head_dim)
    v_flat = v_pages.reshape(-1, page_size, head_dim)
    has_new = new_k is not None and new_v is not None
    if has_new and sliding_window is not None:
        # The kernel's query position is seq_lens - 1, one before the new token's: the new
        # token's window of w (itself included) holds w - 1 cached tokens.
        sliding_window -= 1
    max_pages = block_tables.shape[1]
    padded_pages = pl.cdiv(max_pages, pages_per_block) * pages_per_block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))
    kernel = functools.partial(
        _kernel,
        group=group,
        scale=scale,
        page_size=page_size,
        pages_per_block=pages_per_block,
        exact_f32=q_rows.dtype == jnp.float32,
        sliding_window=sliding_window,
        num_kv_heads=num_kv_heads,
        total_pages=total_pages,
        has_new=has_new,
    )
    row_block = pl.BlockSpec((None, None, block_rows, head_dim), lambda b, h, r: (b, h, r, 0))
    page_block = pl.BlockSpec(k_flat.shape, lambda b, h, r: (0, 0, 0))
    per_seq = pl.BlockSpec((1,), lambda b, h, r: (b,))
    new_specs, new_args = [], []
    if new_k is not None and new_v is not None:
        new_block = pl.BlockSpec((None, None, 1, head_dim), lambda b, h, r: (b, h, 0, 0))
        new_specs = [new_block, new_block]
        new_args = [new_k[:, :, None, :], new_v[:, :, None, :]]
    out: jax.Array = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, rows // block_rows),
        in_specs=[
            per_seq,
            per_seq,
            pl.BlockSpec((None, padded_pages), lambda b, h, r: (b, 0)),
            pl.BlockSpec((1,), lambda b, h, r: (0,)),
            row_block,
            page_block,
            page_block,
            *new_specs,
        ],
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="rlax_paged_attention_gpu",
    )(
        seq_lens.astype(jnp.int32),
        q_lens.astype(jnp.int32),
        tables,
        jnp.asarray(layer, jnp.int32).reshape(1),
        q_rows,
        k_flat,
        v_flat,
        *new_args,
    )
    return out
