"""Decode attention over the paged cache in plain XLA, for any platform and dtype.

The CPU engine runs the native kernel of ``cpu.py`` (3-9x faster at its decode shapes);
this path is the portable one (``attention="xla"``, bfloat16 caches) and its cross-check.

The reference (``reference.py``) gathers every page of every sequence into one contiguous
copy and runs a masked softmax over it: simple, but on a CPU that copy is written to and
read back from main memory (hundreds of MiB per layer at a few hundred sequences), and it
dominated the engine's decode step. This path walks the block table a few pages at a time
instead, so each step's gathered pages stay in cache, and it stops at the longest sequence
of the batch rather than at the padded table width (a dynamic trip count).

Two engine-oriented extras:

- ``new_k``/``new_v``: the newest token's K/V, not yet in the cache, joins the softmax
  directly; the caller writes it afterwards (one scatter for all layers, outside the layer
  scan, instead of threading the cache through it).
- ``layer``: ``k_pages``/``v_pages`` may carry a leading layer axis; the pages are read in
  place through ``layer``, because slicing one layer out first would copy it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rlax_kernels.paged_attention.arguments import check_decode_arguments
from rlax_kernels.paged_attention.reference import default_scale

# Tokens gathered per loop step: enough to amortise a step, few enough to stay in cache.
STEP_TOKENS = 32


def _pages_per_step(width: int, page_size: int) -> int:
    """Largest divisor of the table width whose pages hold at most `STEP_TOKENS` tokens (>= 1)."""
    best = 1
    for pages in range(1, width + 1):
        if width % pages == 0 and pages * page_size <= STEP_TOKENS:
            best = pages
    return best


def paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Decode attention (one query per sequence), reading the pages a few at a time.

    Args:
      q: ``[batch, num_heads, head_dim]``.
      k_pages, v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``, or
        ``[num_layers, num_kv_heads, total_pages, page_size, head_dim]`` with ``layer`` given.
      lengths: ``[batch] int32``, cached tokens each query attends to: >= 1, or >= 0 when
        ``new_k``/``new_v`` are given.
      block_tables: ``[batch, max_pages_per_seq] int32``; entries past a sequence's last page
        are never read (page 0 is read in their place and masked).
      scale: softmax temperature; ``1 / sqrt(head_dim)`` when None.
      new_k, new_v: ``[batch, num_kv_heads, head_dim]``, one more token per sequence that is
        not in the cache (attended after the cached ones), or None.
      layer: int32 scalar choosing the layer when the pages carry a layer axis.
      sliding_window: when given, the query sees only the last ``sliding_window`` tokens,
        itself (the new token, or the last cached one) included; the loop starts at the
        first page any sequence of the batch still sees.

    Returns:
      ``[batch, num_heads, head_dim]`` in ``q``'s dtype, computed in float32 (pages of a
      bfloat16 cache are widened after the gather: small bfloat16 dots are ~6x slower on CPU).
    """
    check_decode_arguments(
        "paged_attention_xla", q, k_pages, v_pages, lengths, block_tables,
        new_k=new_k, new_v=new_v, layer=layer, sliding_window=sliding_window,
    )  # fmt: skip
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape[-4:]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    scale = default_scale(head_dim) if scale is None else scale
    step_pages = _pages_per_step(width, page_size)
    step_tokens = step_pages * page_size

    # First cached token each query sees: all of them, or the window's (the query's own
    # position is the last of `lengths` cached tokens plus the new one when it is given).
    seen = lengths + (0 if new_k is None else 1)
    first = jnp.zeros_like(lengths) if sliding_window is None else jnp.maximum(seen - sliding_window, 0)
    used = jnp.arange(width)[None, :] < (lengths[:, None] + page_size - 1) // page_size
    tables = jnp.where(used, block_tables, 0)  # unused entries may be garbage: read page 0
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)

    def read(pages: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Loop step i's pages as float32 [batch, num_kv_heads, step_tokens, head_dim], and which
        of their tokens are cached ([batch, step_tokens] bool)."""
        cols = lax.dynamic_slice_in_dim(tables, i * step_pages, step_pages, axis=1)  # [batch, step_pages]
        token = (i * step_tokens + jnp.arange(step_tokens))[None, :]
        valid = (token < lengths[:, None]) & (token >= first[:, None])
        if layer is None:
            got = jnp.moveaxis(pages[:, cols], 0, 2)  # [batch, step_pages, kv_heads, page_size, head_dim]
        else:  # advanced indices around a slice put the gathered axes first
            got = pages[layer, :, cols]
        got = got.transpose(0, 2, 1, 3, 4)
        return got.reshape(batch, num_kv_heads, step_tokens, head_dim).astype(jnp.float32), valid

    if new_k is None:
        new_scores = jnp.full((batch, num_kv_heads, group), -jnp.inf, jnp.float32)
    else:
        new_scores = (qg * new_k[:, :, None, :].astype(jnp.float32)).sum(axis=-1) * scale

    # Both products are broadcast multiplies and sums rather than einsums: as dots they
    # become thousands of [group, head_dim] x [head_dim, tokens] matmuls per step, whose
    # per-call overhead on CPU exceeds their arithmetic (measured ~25% slower).
    def score_step(i, scores):  # type: ignore[no-untyped-def]
        k, valid = read(k_pages, i)
        s = (qg[:, :, :, None, :] * k[:, :, None]).sum(
            axis=-1
        ) * scale  # [batch, kv_heads, group, step_tokens]
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        return lax.dynamic_update_slice_in_dim(scores, s, i * step_tokens, axis=3)

    def value_step(i, acc):  # type: ignore[no-untyped-def]
        v, valid = read(v_pages, i)
        v = jnp.where(valid[:, None, :, None], v, 0.0)  # a NaN in an unused slot must not meet p = 0
        p = lax.dynamic_slice_in_dim(probs, i * step_tokens, step_tokens, axis=3)
        return acc + (p[..., None] * v[:, :, None]).sum(axis=-2)

    # Two passes over the pages (scores, then values) with one exact softmax between them,
    # rather than an online softmax: the scores are small ([batch, heads, width * page_size]),
    # and without the running rescales the rounding stays that of a dense softmax, which
    # keeps engine logprobs within 1e-5 of a teacher-forced forward pass.
    # Both loops stop at the longest sequence (the table's padded tail costs nothing) and
    # start at the first step that any sequence still sees through its window.
    steps = (jnp.max(lengths) + step_tokens - 1) // step_tokens
    start = jnp.min(first) // step_tokens
    scores = jnp.full((batch, num_kv_heads, group, width * page_size), -jnp.inf, jnp.float32)
    scores = lax.fori_loop(start, steps, score_step, scores)
    peak = jnp.maximum(scores.max(axis=-1), new_scores)  # finite: lengths >= 1 or a new token
    weights = jnp.exp(scores - peak[..., None])
    new_weight = jnp.exp(new_scores - peak)
    denom = weights.sum(axis=-1) + new_weight
    probs = weights / denom[..., None]
    acc: jax.Array = lax.fori_loop(
        start, steps, value_step, jnp.zeros((batch, num_kv_heads, group, head_dim), jnp.float32)
    )
    if new_v is not None:  # the newest token last, as in a dense pass over the whole sequence
        acc = acc + (new_weight / denom)[..., None] * new_v[:, :, None, :].astype(jnp.float32)
    return acc.reshape(batch, num_heads, head_dim).astype(q.dtype)
