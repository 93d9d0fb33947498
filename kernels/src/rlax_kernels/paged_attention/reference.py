"""Pure-jnp references for paged attention: the ground truth every kernel is tested against.

Cache layout (shared by every function of this package and by the inference engine):

- ``k_pages``, ``v_pages``: ``[num_kv_heads, total_pages, page_size, head_dim]``. One page
  of one KV head is a contiguous ``[page_size, head_dim]`` tile, so the TPU kernel moves a
  page with a single DMA and the GPU kernel reads it with unit-stride rows.
- ``block_tables``: ``[batch, max_pages_per_seq] int32``. Entry ``p`` of row ``b`` is the
  physical page that holds tokens ``p * page_size ... (p + 1) * page_size - 1`` of sequence
  ``b``. Entries past ``ceil(length / page_size)`` are ignored and may hold any value.
- Query heads are grouped: query head ``n`` reads KV head ``n // (num_heads // num_kv_heads)``.

The references gather every page of every sequence and run a plain masked softmax in
float32, which is simple enough to check by hand. The CPU's decode paths are the native
kernel of ``cpu.py`` and the plain-XLA ``xla.py`` (same results, a few pages at a time);
prefill on the ``cpu`` and ``xla`` backends is the reference itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rlax_kernels.paged_attention.arguments import check_decode_arguments

_HIGHEST = lax.Precision.HIGHEST


def default_scale(head_dim: int) -> float:
    """The usual ``1 / sqrt(head_dim)`` softmax temperature."""
    scale: float = float(head_dim) ** -0.5  # typeshed types a float to a negative power as Any
    return scale


def gather_pages(pages: jax.Array, block_tables: jax.Array, lengths: jax.Array) -> jax.Array:
    """Gather each sequence's pages into one contiguous run of tokens.

    Args:
      pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      block_tables: ``[batch, max_pages_per_seq] int32``.
      lengths: ``[batch] int32``, valid tokens of each sequence.

    Returns:
      ``[batch, num_kv_heads, max_pages_per_seq * page_size, head_dim]`` in ``pages``' dtype.
      Rows at or past a sequence's length are read from page 0 and must be masked.
    """
    num_kv_heads, total_pages, page_size, head_dim = pages.shape
    batch, max_pages = block_tables.shape
    used = jnp.arange(max_pages, dtype=jnp.int32)[None, :] < (lengths[:, None] + page_size - 1) // page_size
    # Unused entries may be garbage (even out of range): never index with them.
    safe = jnp.where(used, block_tables, 0)
    gathered = pages[:, safe]  # [kv_heads, batch, max_pages, page_size, head_dim]
    gathered = gathered.reshape(num_kv_heads, batch, max_pages * page_size, head_dim)
    return gathered.transpose(1, 0, 2, 3)


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Decode attention (one query token per sequence) over a paged KV cache.

    Args:
      q: ``[batch, num_heads, head_dim]``, the query of each sequence's newest token.
      k_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      lengths: ``[batch] int32``, tokens in the cache for each sequence (>= 1), including
        the newest token, whose K/V must already be written.
      block_tables: ``[batch, max_pages_per_seq] int32``.
      scale: softmax temperature; ``1 / sqrt(head_dim)`` when None.
      sliding_window: when given, the query (position ``lengths - 1``) sees only the last
        ``sliding_window`` tokens, itself included (``ModelConfig.sliding_window``).

    Returns:
      ``[batch, num_heads, head_dim]`` in ``q``'s dtype, computed in float32.
    """
    check_decode_arguments(
        "paged_attention_reference", q, k_pages, v_pages, lengths, block_tables, sliding_window=sliding_window
    )
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    scale = default_scale(head_dim) if scale is None else scale
    k = gather_pages(k_pages, block_tables, lengths).astype(jnp.float32)
    v = gather_pages(v_pages, block_tables, lengths).astype(jnp.float32)
    positions = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
    valid = positions < lengths[:, None]  # [batch, tokens]
    if sliding_window is not None:
        valid &= positions >= lengths[:, None] - sliding_window
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision=_HIGHEST) * scale
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A NaN planted in an unused slot must not reach the output through 0 * NaN.
    v = jnp.where(valid[:, None, :, None], v, 0.0)
    out = jnp.einsum("bhgt,bhtd->bhgd", probs, v, precision=_HIGHEST)
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)


def paged_prefill_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    seq_lens: jax.Array,
    q_lens: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Causal attention of a chunk of new tokens per sequence over the paged cache.

    The chunk's own K/V must already be written to the cache (``write_kv``), so the
    chunk attends to the cached prefix and to itself through the same pages.

    Args:
      q: ``[batch, chunk, num_heads, head_dim]``, the queries of up to ``chunk`` new tokens
        per sequence; rows at or past ``q_lens[b]`` are padding.
      k_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      seq_lens: ``[batch] int32``, tokens in the cache after the chunk was written (>= 1); query
        row ``j`` sits at absolute position ``seq_lens[b] - q_lens[b] + j``.
      q_lens: ``[batch] int32``, new tokens of each sequence in this chunk
        (``0 <= q_len <= min(chunk, seq_len)``).
      block_tables: ``[batch, max_pages_per_seq] int32``.
      scale: softmax temperature; ``1 / sqrt(head_dim)`` when None.

    Returns:
      ``[batch, chunk, num_heads, head_dim]`` in ``q``'s dtype; padding rows are zero.
    """
    batch, chunk, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    scale = default_scale(head_dim) if scale is None else scale
    k = gather_pages(k_pages, block_tables, seq_lens).astype(jnp.float32)
    v = gather_pages(v_pages, block_tables, seq_lens).astype(jnp.float32)
    tokens = k.shape[2]
    rows = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    q_pos = seq_lens[:, None] - q_lens[:, None] + rows  # [batch, chunk]
    q_valid = rows < q_lens[:, None]
    k_pos = jnp.arange(tokens, dtype=jnp.int32)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]  # [batch, chunk, tokens]
    qg = q.reshape(batch, chunk, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("bchgd,bhtd->bhgct", qg, k, precision=_HIGHEST) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    # Padding rows see no key at all; give them a finite row so softmax stays NaN-free.
    scores = jnp.where(q_valid[:, None, None, :, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    k_valid = k_pos[None, :] < seq_lens[:, None]
    v = jnp.where(k_valid[:, None, :, None], v, 0.0)
    out = jnp.einsum("bhgct,bhtd->bchgd", probs, v, precision=_HIGHEST)
    out = jnp.where(q_valid[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, chunk, num_heads, head_dim).astype(q.dtype)
