"""Writing new K/V rows into the paged cache (an XLA scatter on every backend).

A slot is a flat row index into the cache: ``slot = page * page_size + offset``. A
negative slot marks a padding token and is ignored, which lets a fixed-size (bucketed)
batch of new tokens carry padding without a branch.

This is deliberately an XLA path, not a Pallas kernel: it is one scatter of
``num_tokens * num_kv_heads * head_dim`` elements, which XLA performs in place when the
caller's jitted step donates the cache buffers (``donate_argnums``), so a kernel would add
nothing but code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V rows into their page slots.

    Args:
      k_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      new_k: ``[num_tokens, num_kv_heads, head_dim]``, cast to the cache dtype.
      new_v: ``[num_tokens, num_kv_heads, head_dim]``, cast to the cache dtype.
      slot_mapping: ``[num_tokens] int32``, ``page * page_size + offset`` per token, or
        negative for a padding token (not written). Two tokens must not share a slot.

    Returns:
      ``(k_pages, v_pages)`` updated, same shapes and dtypes. Donate the inputs in the
      caller's jit so the update happens in place.

    Raises:
      ValueError: inconsistent shapes (the message prints them); a slot past the cache when
        ``slot_mapping`` is concrete (under a trace such a row is dropped).
    """
    report = (
        f"k_pages={tuple(k_pages.shape)}, v_pages={tuple(v_pages.shape)}, new_k={tuple(new_k.shape)}, "
        f"new_v={tuple(new_v.shape)}, slot_mapping={tuple(slot_mapping.shape)} {slot_mapping.dtype}"
    )
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"write_kv: k_pages and v_pages must both be [num_kv_heads, total_pages, page_size, head_dim] (got {report})"
        )
    num_kv_heads, total_pages, page_size, head_dim = k_pages.shape
    if new_k.ndim != 3 or new_v.shape != new_k.shape or new_k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"write_kv: new_k and new_v must both be [num_tokens, num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}] (got {report})"
        )
    if slot_mapping.shape != new_k.shape[:1] or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(
            f"write_kv: slot_mapping must be an integer [num_tokens={new_k.shape[0]}] (got {report})"
        )
    capacity = total_pages * page_size
    if not isinstance(slot_mapping, jax.core.Tracer):
        slots_np = np.asarray(slot_mapping)
        if slots_np.size and slots_np.max() >= capacity:
            raise ValueError(
                f"write_kv: slot {int(slots_np.max())} is past the cache's {capacity} slots "
                f"({total_pages} pages of {page_size})"
            )
    slots = slot_mapping.astype(jnp.int32)
    # Padding goes to an out-of-range page so that mode="drop" discards it.
    page = jnp.where(slots >= 0, slots // page_size, total_pages)
    offset = jnp.where(slots >= 0, slots % page_size, 0)
    k_rows = new_k.astype(k_pages.dtype).transpose(1, 0, 2)  # [num_kv_heads, num_tokens, head_dim]
    v_rows = new_v.astype(v_pages.dtype).transpose(1, 0, 2)
    k_pages = k_pages.at[:, page, offset].set(k_rows, mode="drop")
    v_pages = v_pages.at[:, page, offset].set(v_rows, mode="drop")
    return k_pages, v_pages


def slots_from_positions(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Cache slots of token positions, given each token's row of the block table.

    Args:
      block_tables: ``[num_tokens, max_pages_per_seq] int32``, the block-table row of the
        sequence each token belongs to.
      positions: ``[num_tokens] int32``, position of each token in its sequence; negative
        for padding.
      page_size: tokens per page.

    Returns:
      ``[num_tokens] int32`` slots for ``write_kv`` (-1 for padding).
    """
    pos = positions.astype(jnp.int32)
    safe = jnp.maximum(pos, 0)
    page_idx = jnp.minimum(safe // page_size, block_tables.shape[1] - 1)
    page = jnp.take_along_axis(block_tables.astype(jnp.int32), page_idx[:, None], axis=1)[:, 0]
    return jnp.where(pos >= 0, page * page_size + safe % page_size, -1)
