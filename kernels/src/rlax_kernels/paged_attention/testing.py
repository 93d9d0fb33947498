"""Random paged-cache cases with poison in every unused place (for tests and benchmarks).

Every slot that no sequence owns -- spare pages, the tail of each last page -- holds NaN,
and block-table entries past each sequence's last page point either at a NaN page or far
outside the cache, so a kernel that reads or weights anything it should not produces NaN
(or, in TPU interpret mode, an out-of-bounds error) instead of a plausible number.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_OUT_OF_RANGE = 1 << 20


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """One batch over a paged cache.

    Attributes:
      q: ``[batch, num_heads, head_dim]`` (decode) or ``[batch, chunk, num_heads, head_dim]``.
      k_pages, v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      seq_lens: ``[batch] int32``, valid cache tokens per sequence.
      q_lens: ``[batch] int32``, valid chunk tokens per sequence (ones for decode).
      block_tables: ``[batch, max_pages_per_seq] int32``.
    """

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    seq_lens: jax.Array
    q_lens: jax.Array
    block_tables: jax.Array


def make_paged_case(
    seed: int,
    *,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: jnp.dtype = jnp.float32,
    chunk: int | None = None,
    q_lens: list[int] | None = None,
    spare_pages: int = 3,
    extra_table_columns: int = 1,
    poison: bool = True,
) -> PagedCase:
    """Build a random case; ``chunk=None`` gives a decode query ``[batch, num_heads, head_dim]``.

    Pages are assigned to sequences in a random order so that no kernel can rely on
    contiguity. With ``poison``, unused cache slots and padding query rows are NaN.
    """
    rng = np.random.default_rng(seed)
    batch = len(seq_lens)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    used_pages = sum(pages_per_seq)
    total_pages = used_pages + spare_pages
    max_pages = max(pages_per_seq) + extra_table_columns
    order = rng.permutation(total_pages)
    spare = order[used_pages:]

    fill = np.nan if poison else 0.0
    shape = (num_kv_heads, total_pages, page_size, head_dim)
    k_pages = np.full(shape, fill, np.float32)
    v_pages = np.full(shape, fill, np.float32)
    tables = np.zeros((batch, max_pages), np.int64)
    cursor = 0
    for b, (length, n_pages) in enumerate(zip(seq_lens, pages_per_seq)):
        pages = order[cursor : cursor + n_pages]
        cursor += n_pages
        tables[b, :n_pages] = pages
        for col in range(n_pages, max_pages):
            # Unused entries: a NaN page, or an address far outside the cache.
            tables[b, col] = spare[col % len(spare)] if (col % 2 == 0 and len(spare)) else _OUT_OF_RANGE
        for p, page in enumerate(pages):
            rows = min(page_size, length - p * page_size)
            k_pages[:, page, :rows] = rng.standard_normal((num_kv_heads, rows, head_dim))
            v_pages[:, page, :rows] = rng.standard_normal((num_kv_heads, rows, head_dim))

    if chunk is None:
        q = rng.standard_normal((batch, num_heads, head_dim)).astype(np.float32)
        q_len_arr = np.ones(batch, np.int32)
    else:
        q_len_arr = np.asarray(q_lens if q_lens is not None else [min(chunk, n) for n in seq_lens], np.int32)
        q = rng.standard_normal((batch, chunk, num_heads, head_dim)).astype(np.float32)
        if poison:
            for b in range(batch):
                q[b, q_len_arr[b] :] = np.nan
    return PagedCase(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k_pages, dtype),
        v_pages=jnp.asarray(v_pages, dtype),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        q_lens=jnp.asarray(q_len_arr, jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32),
    )
