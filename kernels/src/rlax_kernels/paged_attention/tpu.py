"""Pallas TPU (Mosaic) kernel for attention over a paged KV cache (decode and prefill).

One kernel serves both paths. Queries arrive as *rows* grouped by KV head:
``q_rows: [batch, num_kv_heads, rows, head_dim]`` with ``rows = chunk * group`` and row
``r`` holding query head ``r % group`` of chunk token ``r // group``. Decode is the case
``chunk = 1``: one block holds every query head that shares a KV head.

Grid ``(batch, num_kv_heads, row_blocks, kv_blocks)``; the last axis walks the sequence's
pages ``pages_per_block`` at a time:

- ``seq_lens``, ``q_lens`` and the flattened block tables are scalar-prefetched into SMEM,
  so page indices are known before the body runs and DMAs can be issued at once;
- K/V pages stay in HBM (``memory_space=ANY``) and are copied page by page into a
  two-slot VMEM buffer with ``make_async_copy``: while block ``i`` is computed, block
  ``i + 1`` is already in flight (double buffering);
- an online softmax (running max, running sum, float32 accumulator; ``online_softmax.py``,
  shared with the GPU kernel) lives in VMEM scratch across KV blocks; the output block is written once, at the last KV step;
- KV blocks past what the row block can see causally issue no DMA and no compute; in the
  last block, page slots past the sequence's last page re-read that page (no DMA follows
  an unused block-table entry), and key rows at or past the length are masked in both the
  scores and the values, so garbage (even NaN) in unused slots never reaches the output.

Not run on TPU hardware in this repository's CI: tests run it in Pallas' TPU interpret
mode (``pltpu.InterpretParams``, which simulates VMEM, DMAs and semaphores on the CPU)
and lower it to Mosaic for a TPU target without compiling it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rlax_kernels.paged_attention.online_softmax import (
    online_softmax_add_key,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_update,
)


def _kernel(
    seq_lens_ref: jax.Ref,  # SMEM [batch] int32
    q_lens_ref: jax.Ref,  # SMEM [batch] int32
    tables_ref: jax.Ref,  # SMEM [batch * max_pages] int32
    layer_ref: jax.Ref,  # SMEM [1] int32, the layer of the cache to read
    q_ref: jax.Ref,  # VMEM [block_rows, head_dim]
    k_hbm: jax.Ref,  # HBM [num_layers, num_kv_heads, total_pages, page_size, head_dim]
    v_hbm: jax.Ref,  # HBM [num_layers, num_kv_heads, total_pages, page_size, head_dim]
    *refs: jax.Ref,  # (new_k_ref, new_v_ref: VMEM [1, head_dim], with has_new), o_ref, scratch...
    group: int,
    scale: float,
    page_size: int,
    pages_per_block: int,
    max_pages: int,
    sliding_window: int | None,
    has_new: bool,
) -> None:
    if has_new:
        new_k_ref, new_v_ref, *rest = refs
        refs = tuple(rest)
    (
        o_ref,  # VMEM [block_rows, head_dim]
        k_buf,  # VMEM [2, block_tokens, head_dim]
        v_buf,  # VMEM [2, block_tokens, head_dim]
        k_sem,  # DMA semaphores [2]
        v_sem,  # DMA semaphores [2]
        m_ref,  # VMEM [block_rows, 1] float32, running max
        l_ref,  # VMEM [block_rows, 1] float32, running sum
        acc_ref,  # VMEM [block_rows, head_dim] float32
    ) = refs
    layer = layer_ref[0]
    b = pl.program_id(0)
    h = pl.program_id(1)
    rb = pl.program_id(2)
    i = pl.program_id(3)
    block_rows = q_ref.shape[0]
    block_tokens = pages_per_block * page_size
    length = seq_lens_ref[b]
    q_len = q_lens_ref[b]
    last_page = (length + page_size - 1) // page_size - 1

    # Chunk tokens covered by this row block, and how far into the cache the last can see.
    first_tok = rb * block_rows // group
    last_tok = jnp.minimum(((rb + 1) * block_rows - 1) // group, q_len - 1)
    visible = length - q_len + last_tok + 1
    n_blocks = jnp.where(first_tok < q_len, (visible + block_tokens - 1) // block_tokens, 0)
    # With a window, the blocks before the first key this row block's first token sees are
    # skipped: grid step i computes block `first_block + i`.
    first_key = (
        0 if sliding_window is None else jnp.maximum(length - q_len + first_tok - sliding_window + 1, 0)
    )
    first_block = jnp.minimum(first_key // block_tokens, n_blocks)
    n_steps = n_blocks - first_block

    # list[Any]: the copy descriptor's class is private to JAX (jax._src.pallas.mosaic).
    def block_copies(block: jax.Array, slot: jax.Array | int) -> list[Any]:
        copies = []
        for j in range(pages_per_block):
            page_in_seq = jnp.minimum(block * pages_per_block + j, last_page)
            page = tables_ref[b * max_pages + page_in_seq]
            rows = pl.ds(j * page_size, page_size)
            copies.append(
                pltpu.make_async_copy(k_hbm.at[layer, h, page], k_buf.at[slot, rows], k_sem.at[slot])
            )
            copies.append(
                pltpu.make_async_copy(v_hbm.at[layer, h, page], v_buf.at[slot, rows], v_sem.at[slot])
            )
        return copies

    @pl.when(i == 0)
    def _start() -> None:
        m_ref[...], l_ref[...], acc_ref[...] = online_softmax_init(*acc_ref.shape, keepdims=True)

        @pl.when(n_steps > 0)
        def _fetch_first() -> None:
            for copy in block_copies(first_block, 0):
                copy.start()

    @pl.when(i < n_steps)
    def _step() -> None:
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < n_steps)
        def _prefetch_next() -> None:
            for copy in block_copies(first_block + i + 1, 1 - slot):
                copy.start()

        for copy in block_copies(first_block + i, slot):
            copy.wait()

        start = (first_block + i) * block_tokens
        row_tok = (rb * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)) // group
        q_pos = length - q_len + row_tok  # [block_rows, 1]
        k_pos = start + lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        allowed = (k_pos <= q_pos) & (k_pos < length) & (k_pos >= first_key)  # [block_rows, block_tokens]
        if sliding_window is not None:
            allowed &= q_pos - k_pos < sliding_window
        key_pos = start + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
        key_valid = (key_pos < length) & (key_pos >= first_key)

        scores = lax.dot_general(
            q_ref[...], k_buf[slot], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        scores = jnp.where(allowed, scores * scale, -jnp.inf)
        v = v_buf[slot]
        v = jnp.where(key_valid, v, jnp.zeros_like(v))
        state = (m_ref[...], l_ref[...], acc_ref[...])
        m_ref[...], l_ref[...], acc_ref[...] = online_softmax_update(state, scores, v)

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish() -> None:
        row_tok = (rb * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)) // group
        state = (m_ref[...], l_ref[...], acc_ref[...])
        if has_new:  # the newest token, not in the cache, joins the softmax last
            q = q_ref[...].astype(jnp.float32)
            s_new = jnp.sum(q * new_k_ref[...].astype(jnp.float32), axis=1, keepdims=True) * scale
            state = online_softmax_add_key(state, s_new, new_v_ref[...])
        out = online_softmax_finish(state)
        o_ref[...] = jnp.where(row_tok < q_len, out, 0.0).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("group", "scale", "pages_per_block", "block_rows", "interpret", "sliding_window"),
)
def paged_attention_rows_tpu(
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
    interpret: bool | pltpu.InterpretParams = False,
    sliding_window: int | None = None,
    layer: jax.Array | int | None = None,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
) -> jax.Array:
    """Run the Pallas TPU kernel on KV-head-grouped query rows (inputs already validated).

    Args:
      q_rows: ``[batch, num_kv_heads, rows, head_dim]``; ``rows`` a multiple of ``block_rows``
        (row ``r`` is query head ``r % group`` of chunk token ``r // group``).
      k_pages, v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      seq_lens: ``[batch] int32``, cache tokens per sequence including this chunk (>= 1).
      q_lens: ``[batch] int32``, valid chunk tokens per sequence; the rest are padding.
      block_tables: ``[batch, max_pages_per_seq] int32``.
      group: query heads per KV head.
      scale: softmax temperature.
      pages_per_block: pages moved and computed per grid step (<= ``max_pages_per_seq``).
      block_rows: query rows per program.
      interpret: run in Pallas' TPU interpret mode on the CPU; ``True`` uses default
        ``pltpu.InterpretParams``, an instance chooses them (e.g. ``detect_races=True``).
      sliding_window: when given, a query at position ``p`` sees keys ``p - sliding_window < k <= p``
        (the blocks before a row block's first visible key are not fetched).
      layer: int32 scalar: ``k_pages``/``v_pages`` carry a leading layer axis
        (``[num_layers, num_kv_heads, total_pages, page_size, head_dim]``) and the kernel's
        DMAs read this layer's pages in place (scalar-prefetched; nothing is sliced or copied).
      new_k, new_v: ``[batch, num_kv_heads, head_dim]``, the newest token of each sequence
        (decode only, ``rows == block_rows``), not in the cache: ``seq_lens`` then counts the
        cached tokens only (>= 0, ``q_lens`` 1) and the token joins the softmax last; its
        position is ``seq_lens``, so a window counts it.

    Returns:
      ``[batch, num_kv_heads, rows, head_dim]`` in ``q_rows``' dtype; padding rows are zero.
    """
    batch, num_kv_heads, rows, head_dim = q_rows.shape
    if layer is None:  # a free reshape: one layer
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    page_size = k_pages.shape[3]
    max_pages = block_tables.shape[1]
    kv_blocks = pl.cdiv(max_pages, pages_per_block)
    block_tokens = pages_per_block * page_size
    has_new = new_k is not None and new_v is not None
    if has_new and sliding_window is not None:
        # The kernel's query position is seq_lens - 1, one before the new token's: the new
        # token's window of w (itself included) holds w - 1 cached tokens.
        sliding_window -= 1

    row_block = pl.BlockSpec((None, None, block_rows, head_dim), lambda b, h, r, i, *_: (b, h, r, 0))
    new_specs, new_args = [], []
    if new_k is not None and new_v is not None:
        new_block = pl.BlockSpec((None, None, 1, head_dim), lambda b, h, r, i, *_: (b, h, 0, 0))
        new_specs = [new_block, new_block]
        new_args = [new_k[:, :, None, :], new_v[:, :, None, :]]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(batch, num_kv_heads, rows // block_rows, kv_blocks),
        in_specs=[
            row_block,
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
            *new_specs,
        ],
        out_specs=row_block,
        scratch_shapes=[
            pltpu.VMEM((2, block_tokens, head_dim), k_pages.dtype),
            pltpu.VMEM((2, block_tokens, head_dim), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((block_rows, 1), jnp.float32),
            pltpu.VMEM((block_rows, 1), jnp.float32),
            pltpu.VMEM((block_rows, head_dim), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel,
        group=group,
        scale=scale,
        page_size=page_size,
        pages_per_block=pages_per_block,
        max_pages=max_pages,
        sliding_window=sliding_window,
        has_new=has_new,
    )
    out: jax.Array = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret
        if isinstance(interpret, pltpu.InterpretParams)
        else (pltpu.InterpretParams() if interpret else False),
        name="rlax_paged_attention_tpu",
    )(
        seq_lens.astype(jnp.int32),
        q_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        jnp.asarray(layer, jnp.int32).reshape(1),
        q_rows,
        k_pages,
        v_pages,
        *new_args,
    )
    return out
