"""Argument checks shared by every paged-attention entry point (``ops``, ``cpu``, ``xla``, ``reference``).

Shapes are static, so the checks run eagerly and also under an outer ``jax.jit``; a bad
argument fails here with every argument's shape and dtype in the message, never as a
wrong read inside a kernel (the native CPU kernel indexes raw memory by these shapes).
"""

from __future__ import annotations

from typing import NoReturn

import jax
import jax.numpy as jnp
import numpy as np


def shape_report(**arrays: jax.Array | None) -> str:
    """``name=(shape) dtype`` of every array given (None skipped), for error messages."""
    return ", ".join(f"{name}={tuple(a.shape)} {a.dtype}" for name, a in arrays.items() if a is not None)


def check_cache_and_tables(
    where: str,
    num_heads: int,
    head_dim: int,
    q_dtype: np.dtype,
    k_pages: jax.Array | jax.ShapeDtypeStruct,
    v_pages: jax.Array | jax.ShapeDtypeStruct,
    batch: int,
    block_tables: jax.Array,
    report: str,
    *,
    one_dtype: bool = True,
) -> None:
    """One layer's ``[num_kv_heads, total_pages, page_size, head_dim]`` pages and the block
    tables against ``q``'s heads, all floating point; with `one_dtype`, of q's dtype."""

    def fail(why: str) -> NoReturn:
        raise ValueError(f"{where}: {why} (got {report})")

    if k_pages.ndim != 4:
        fail("k_pages must be [num_kv_heads, total_pages, page_size, head_dim]")
    if v_pages.shape != k_pages.shape:
        fail("v_pages must have the shape of k_pages")
    num_kv_heads, total_pages, page_size, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        fail(f"q's head_dim {head_dim} differs from the cache's head_dim {kv_head_dim}")
    if min(num_kv_heads, total_pages, page_size) < 1:
        fail("the cache needs at least one KV head, one page and one slot per page")
    if num_heads % num_kv_heads != 0:
        fail(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if one_dtype and not (q_dtype == k_pages.dtype == v_pages.dtype):
        fail("q, k_pages and v_pages must share one dtype")
    if not all(jnp.issubdtype(d, jnp.floating) for d in (q_dtype, k_pages.dtype, v_pages.dtype)):
        fail("q, k_pages and v_pages must be floating point")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        fail(f"block_tables must be [batch={batch}, max_pages_per_seq>=1]")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        fail("block_tables must be an integer array")


def check_lengths(where: str, name: str, lengths: jax.Array, batch: int, report: str) -> None:
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{where}: {name} must be an integer array of shape [batch={batch}] (got {report})")


def check_sliding_window(where: str, sliding_window: int | None) -> None:
    """A window is None (no window) or a positive int (static: it shapes the compiled program)."""
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
    ):
        raise ValueError(f"{where}: sliding_window must be None or an int >= 1, got {sliding_window!r}")


def check_decode_arguments(
    where: str,
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
    one_dtype: bool = False,
) -> None:
    """The arguments of a decode attention: ``q [batch, num_heads, head_dim]``; pages of one
    layer, or of every layer (rank 5) exactly when `layer` is given; ``lengths [batch]``;
    ``block_tables [batch, max_pages_per_seq]``; the newest token's ``new_k``/``new_v``
    ``[batch, num_kv_heads, head_dim]`` together or not at all; a static window.

    `one_dtype`: q, the pages and new_k/new_v must share q's dtype (the Pallas kernels'
    need; the CPU and XLA paths widen each to float32 themselves).
    """
    report = shape_report(
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        lengths=lengths,
        block_tables=block_tables,
        new_k=new_k,
        new_v=new_v,
    )
    if q.ndim != 3:
        raise ValueError(f"{where}: q must be [batch, num_heads, head_dim] (got {report})")
    batch, num_heads, head_dim = q.shape
    # A 5-D cache (with `layer`) is checked as one layer of it.
    k_layer, v_layer = (
        jax.ShapeDtypeStruct(p.shape[1:], p.dtype) if p.ndim == 5 else p for p in (k_pages, v_pages)
    )
    check_cache_and_tables(
        where,
        num_heads,
        head_dim,
        q.dtype,
        k_layer,
        v_layer,
        batch,
        block_tables,
        report,
        one_dtype=one_dtype,
    )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{where}: v_pages must have the shape of k_pages (got {report})")
    if (layer is None) != (k_pages.ndim == 4):
        raise ValueError(
            f"{where}: pages of rank {k_pages.ndim} need layer="
            f"{'an index' if k_pages.ndim == 5 else 'None'} (k_pages {k_pages.shape})"
        )
    if (new_k is None) != (new_v is None):
        raise ValueError(f"{where}: pass new_k and new_v together")
    check_lengths(where, "lengths", lengths, batch, report)
    num_kv_heads = k_pages.shape[-4]
    for extra in (x for x in (new_k, new_v) if x is not None):
        if extra.shape != (batch, num_kv_heads, head_dim) or (one_dtype and extra.dtype != q.dtype):
            in_dtype = " in q's dtype" if one_dtype else ""
            raise ValueError(
                f"{where}: new_k and new_v must be [batch={batch}, num_kv_heads={num_kv_heads}, "
                f"head_dim={head_dim}]{in_dtype} (got {report})"
            )
    check_sliding_window(where, sliding_window)
