"""Decode attention over the paged cache as a native CPU kernel, called from XLA through its FFI.

On a CPU, decode attention is memory-bound work that XLA expresses poorly: every layout of
it (gathered pages, dense copies, einsums) spends most of its time in gathers, transposes
and short reductions over ``head_dim``, reaching about a third of the memory bandwidth that
a plain loop over the pages reaches. This module is that loop: a numba (LLVM) kernel that,
for each (sequence, KV head), walks the block table page by page, scores the tokens for all
query heads of the group, takes one exact softmax and sums the values -- the same two
passes as ``paged_attention_xla`` -- with sequences spread over the CPU cores.

XLA calls it through the typed FFI (``jax.ffi.ffi_call``): the handler is a numba ``cfunc``
that reads the buffers straight from XLA's call frame, so the cache is never copied and no
Python runs inside a step. The call frame layout is XLA's stable C ABI
(``xla/ffi/api/c_api.h``, shipped in ``jax.ffi.include_dir()``); `cpu_ffi` reads it, checks
every field the kernel uses before touching memory, and reports failures back to XLA. The kernel compiles on first use (a few seconds; numba caches it on disk).

Threads: sequences are spread over the cores by numba's ``workqueue`` layer, chosen here
unless the process already picked one (``NUMBA_THREADING_LAYER``, or numba code that ran
in parallel earlier). Numba's OpenMP layer would share ``libgomp`` with PyTorch, and since
XLA calls the kernel from several of its own threads, each of which gets its own OpenMP
team, libgomp then counts more threads than cores and stops spinning between PyTorch's
parallel regions: transformers ran at half speed in the same process (measured). The
workqueue layer cannot take two launches at once, so launches are serialised by a lock in
the handler (each launch uses every core anyway).

Arguments, extras (``new_k``/``new_v``, ``layer``) and results are those of
``paged_attention_xla``; the pages must be float32 (the CPU engine keeps a float32 cache).
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
import numba
import numpy as np
from numba import types

from rlax_kernels.paged_attention.arguments import check_decode_arguments
from rlax_kernels.paged_attention.cpu_ffi import make_handler
from rlax_kernels.paged_attention.cpu_intrinsics import float_bits, prefetch
from rlax_kernels.paged_attention.reference import default_scale

_TARGET = "rlax_paged_attention_cpu"

# Reassociation lets LLVM vectorise the head_dim dot products; results differ from XLA's
# only by float32 rounding (checked against the reference in the tests).
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# One int32 in memory that outlives every call: 0 free, 1 held (see `spin_acquire`).
_LAUNCH_LOCK = np.zeros(1, np.int32)
_LAUNCH_LOCK_ADDRESS = _LAUNCH_LOCK.ctypes.data


@numba.njit(inline="always")
def _prefetch_page(pages, layer, h, tables, b, p, num_table_pages):  # type: ignore[no-untyped-def]
    """Prefetch page `p` of sequence b's table (KV head h), if the sequence has it.

    Pages are scattered through the cache, so the hardware prefetcher cannot guess the next
    one; asking two pages ahead hides most of the memory latency (~1.3x at decode shapes).
    """
    if p < num_table_pages:
        page = tables[b, p]
        page = page if 0 <= page < pages.shape[2] else 0
        start = pages[layer, h, page].ctypes.data
        for line in range(0, pages.shape[3] * pages.shape[4] * 4, 64):
            prefetch(start + line)


@numba.njit(inline="always", fastmath=_FASTMATH)
def _exp(x):  # type: ignore[no-untyped-def]
    """exp(x) for float32 x <= 0, in plain arithmetic so that LLVM vectorises the softmax loop.

    libm's expf is a scalar call that took half the kernel's time. Cephes' expf: x = n ln2 + r
    with |r| <= ln2 / 2, a degree-7 polynomial for exp(r), 2^n from the exponent bits; relative
    error below 1e-7 (tested). Inputs below -87 give 2^-126 (that of -87.3) instead of underflowing.
    """
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln2 in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * float_bits(np.int32(n + np.float32(127.0)) << 23)


@numba.njit(parallel=True, fastmath=_FASTMATH, boundscheck=False, cache=True)
def _attend(q, k, v, lengths, tables, new_k, new_v, layer, has_new, window, scale, out):  # type: ignore[no-untyped-def]
    """out[b, h*G+g] = softmax(q . [cached K ; new K]) @ [cached V ; new V], per (sequence, KV head).

    q, out: [B, H, D]; k, v: [L, KVH, P, PS, D]; lengths: [B]; tables: [B, W];
    new_k, new_v: [B, KVH, D] (read when has_new). window > 0: only the last `window` of the
    tokens (cached, then new) are attended, and pages before them are not read. Table
    entries outside [0, P) read page 0 and lengths are clipped to the table, so a bad table
    cannot read outside the cache.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = k.shape[1], k.shape[2], k.shape[3]
    width = tables.shape[1]
    group = num_heads // num_kv_heads
    for task in numba.prange(batch * num_kv_heads):
        b = task // num_kv_heads
        h = task % num_kv_heads
        n = min(max(lengths[b], 0), width * page_size)
        total = n + 1 if has_new else n
        first = max(total - window, 0) if window > 0 else 0  # first token seen
        first_page = first // page_size
        qs = np.empty((group, head_dim), np.float32)
        for g in range(group):
            for d in range(head_dim):
                qs[g, d] = q[b, h * group + g, d] * scale
        scores = np.empty((group, max(total, 1)), np.float32)
        used = (n + page_size - 1) // page_size
        _prefetch_page(k, layer, h, tables, b, first_page, used)
        _prefetch_page(k, layer, h, tables, b, first_page + 1, used)
        for p in range(first_page, used):
            _prefetch_page(k, layer, h, tables, b, p + 2, used)
            page = tables[b, p]
            page = page if 0 <= page < num_pages else 0
            for slot in range(max(first - p * page_size, 0), min(page_size, n - p * page_size)):
                t = p * page_size + slot
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += qs[g, d] * k[layer, h, page, slot, d]
                    scores[g, t] = s
        if has_new:
            for g in range(group):
                s = np.float32(0.0)
                for d in range(head_dim):
                    s += qs[g, d] * new_k[b, h, d]
                scores[g, n] = s
        _prefetch_page(v, layer, h, tables, b, first_page, used)  # loads while the softmax runs
        _prefetch_page(v, layer, h, tables, b, first_page + 1, used)
        acc = np.zeros((group, head_dim), np.float32)
        denom = np.empty(group, np.float32)
        for g in range(group):
            peak = scores[g, first]
            for t in range(first + 1, total):
                peak = max(peak, scores[g, t])
            tot = np.float32(0.0)
            for t in range(first, total):
                e = _exp(scores[g, t] - peak)
                scores[g, t] = e
                tot += e
            denom[g] = tot if total > 0 else np.float32(1.0)
        for p in range(first_page, used):
            _prefetch_page(v, layer, h, tables, b, p + 2, used)
            page = tables[b, p]
            page = page if 0 <= page < num_pages else 0
            for slot in range(max(first - p * page_size, 0), min(page_size, n - p * page_size)):
                t = p * page_size + slot
                for g in range(group):
                    w = scores[g, t]
                    for d in range(head_dim):
                        acc[g, d] += w * v[layer, h, page, slot, d]
        for g in range(group):
            w = scores[g, n] if has_new else np.float32(0.0)
            inv = np.float32(1.0) / denom[g]
            for d in range(head_dim):
                extra = w * new_v[b, h, d] if has_new else np.float32(0.0)
                out[b, h * group + g, d] = (acc[g, d] + extra) * inv


@functools.cache
def compiled_handler() -> numba.core.ccallback.CFunc:
    """The FFI handler as a C function (`cpu_ffi.make_handler` around `_attend`), compiled once per process."""
    from numba.np.ufunc import parallel

    if "NUMBA_THREADING_LAYER" not in os.environ and not parallel._is_initialized:
        # numba.config sets its attributes from the environment at import: mypy sees none of them.
        numba.config.THREADING_LAYER = "workqueue"  # type: ignore[attr-defined]  # see the module docstring
    return numba.cfunc(types.voidptr(types.voidptr))(make_handler(_attend, _LAUNCH_LOCK_ADDRESS))


@functools.cache
def _register() -> None:
    """Compiles the handler (or loads it from numba's cache) and registers it with XLA, once per process."""
    handler = compiled_handler()
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    new_capsule.restype = ctypes.py_object
    jax.ffi.register_ffi_target(_TARGET, new_capsule(handler.address, None, None), platform="cpu")


def paged_attention_cpu(
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
    """Decode attention as a native CPU kernel; arguments and result as ``paged_attention_xla``.

    Args:
      q: ``[batch, num_heads, head_dim]``.
      k_pages, v_pages: float32 ``[num_kv_heads, total_pages, page_size, head_dim]``, or
        ``[num_layers, num_kv_heads, total_pages, page_size, head_dim]`` with ``layer`` given.
      lengths: ``[batch] int32``, cached tokens each query attends to (>= 1, or >= 0 with
        ``new_k``/``new_v``); clipped to the table's capacity.
      block_tables: ``[batch, max_pages_per_seq] int32``; only a sequence's first
        ``ceil(lengths / page_size)`` entries are read, and entries outside the cache read page 0.
      scale: softmax temperature; ``1 / sqrt(head_dim)`` when None.
      new_k, new_v: ``[batch, num_kv_heads, head_dim]``, one more token per sequence, not in
        the cache (attended after the cached ones), or None.
      layer: int32 scalar choosing the layer when the pages carry a layer axis.
      sliding_window: when given, the query sees only the last ``sliding_window`` tokens,
        itself included; the pages before them are not read.

    Returns:
      ``[batch, num_heads, head_dim]`` in ``q``'s dtype, computed in float32.
    """
    # The kernel indexes raw memory by these shapes: any inconsistency is an error here, not a bad read.
    check_decode_arguments(
        "paged_attention_cpu", q, k_pages, v_pages, lengths, block_tables,
        new_k=new_k, new_v=new_v, layer=layer, sliding_window=sliding_window,
    )  # fmt: skip
    if k_pages.dtype != jnp.float32 or v_pages.dtype != jnp.float32:
        raise ValueError(
            f"paged_attention_cpu: the pages must be float32, got k_pages {k_pages.dtype}, "
            f"v_pages {v_pages.dtype} (the CPU kernel reads a float32 cache)"
        )
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[-4]
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    if new_k is None or new_v is None:  # both or neither (checked above)
        new_k = new_v = jnp.zeros((batch, num_kv_heads, head_dim), jnp.float32)
        has_new = 0
    else:
        has_new = 1
    scale = default_scale(head_dim) if scale is None else scale
    _register()
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((batch, num_heads, head_dim), jnp.float32))
    out = call(
        q.astype(jnp.float32),
        k_pages,
        v_pages,
        lengths.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        new_k.astype(jnp.float32),
        new_v.astype(jnp.float32),
        jnp.stack([jnp.asarray(layer, jnp.int32), jnp.int32(has_new), jnp.int32(sliding_window or 0)]),
        jnp.asarray(scale, jnp.float32).reshape(1),
    )
    return out.astype(q.dtype)
