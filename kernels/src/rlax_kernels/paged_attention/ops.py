"""Public entry points: shape checks, backend dispatch and query-row packing.

``paged_attention`` (decode) and ``paged_prefill_attention`` (chunked prefill) validate
their arguments eagerly -- shapes are static, so this also works under an outer
``jax.jit`` -- and then call one jitted implementation that packs the queries into
KV-head-grouped rows and runs the chosen backend:

- ``"pallas_tpu"``: the Mosaic kernel of ``tpu.py`` (async page DMAs, double buffering);
- ``"pallas_gpu"``: the Triton kernel of ``gpu.py``;
- ``"cpu"``: decode as the native CPU kernel of ``cpu.py`` (numba, called through XLA's
  FFI; float32 caches), prefill as ``"xla"``: what the CPU engine runs;
- ``"xla"``: ``xla.py`` for decode (a few pages at a time, two passes around one exact
  softmax, checked against the reference) and the pure-jnp reference of ``reference.py`` for
  prefill: any platform, any dtype;
- ``"auto"``: by ``jax.default_backend()``: tpu -> pallas_tpu, gpu -> pallas_gpu,
  cpu -> cpu (xla for a cache that is not float32), anything else -> xla.

A Pallas backend requested on a platform that cannot compile it needs ``interpret=True``
(Pallas' interpreter on the CPU; the TPU kernel uses the TPU interpret mode that simulates
DMAs and semaphores); otherwise it is an error, never a silent fallback.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from rlax_kernels.paged_attention.arguments import (
    check_cache_and_tables,
    check_decode_arguments,
    check_lengths,
    shape_report,
)
from rlax_kernels.paged_attention.cpu import paged_attention_cpu
from rlax_kernels.paged_attention.gpu import paged_attention_rows_gpu
from rlax_kernels.paged_attention.reference import default_scale, paged_prefill_attention_reference
from rlax_kernels.paged_attention.tpu import paged_attention_rows_tpu
from rlax_kernels.paged_attention.xla import paged_attention_xla

Backend = Literal["auto", "cpu", "xla", "pallas_tpu", "pallas_gpu"]
_BACKENDS = ("auto", "cpu", "xla", "pallas_tpu", "pallas_gpu")
_PLATFORM_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "cpu": "cpu"}

# Tokens per compute block when the caller gives no `pages_per_compute_block`: large
# enough to amortise a grid step on TPU, small enough to stay in registers with Triton.
_TPU_BLOCK_TOKENS = 256
_GPU_BLOCK_TOKENS = 64
_TPU_MAX_BLOCK_ROWS = 256
_GPU_MAX_BLOCK_ROWS = 64


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _platform() -> str:
    platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def resolve_backend(backend: str, interpret: bool) -> str:
    """The concrete backend (``cpu``, ``xla``, ``pallas_tpu`` or ``pallas_gpu``) a call will run.

    Raises:
      ValueError: unknown backend, ``interpret`` without a named Pallas kernel, the ``cpu``
        kernel off the CPU, or a Pallas kernel requested on a platform that cannot run it
        natively without ``interpret=True``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    platform = _platform()
    if backend == "auto":
        if interpret:
            raise ValueError(
                "interpret=True needs a named kernel: pass backend='pallas_tpu' or backend='pallas_gpu'"
            )
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "cpu"}.get(platform, "xla")
    if backend in ("xla", "cpu"):
        if interpret:
            raise ValueError(f"interpret=True applies to the Pallas kernels only, not backend={backend!r}")
        if backend == "cpu" and platform != "cpu":
            raise ValueError(f"backend='cpu' runs on the CPU only, but the default backend is {platform!r}")
        return backend
    if not interpret and platform != _PLATFORM_OF[backend]:
        raise ValueError(
            f"backend={backend!r} compiles only on {_PLATFORM_OF[backend]}, but the default "
            f"backend is {platform!r}; pass interpret=True to run it in Pallas interpret mode"
        )
    return backend


def _concrete(x: jax.Array) -> np.ndarray | None:
    """The values of `x` when they are known outside a trace, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_length_values(
    where: str, seq_lens: jax.Array, capacity: int, q_lens: jax.Array | None, minimum: int = 1
) -> None:
    lens = _concrete(seq_lens)
    if lens is not None and lens.size and (lens.min() < minimum or lens.max() > capacity):
        raise ValueError(
            f"{where}: every sequence length must be in [{minimum}, max_pages_per_seq * page_size = {capacity}], "
            f"got {lens.tolist()}"
        )
    if q_lens is None:
        return
    qls = _concrete(q_lens)
    if qls is not None and qls.size and qls.min() < 0:
        raise ValueError(f"{where}: q_lens must be >= 0, got {qls.tolist()}")
    if lens is not None and qls is not None and np.any(qls > lens):
        raise ValueError(
            f"{where}: q_lens must not exceed seq_lens, got q_lens={qls.tolist()} seq_lens={lens.tolist()}"
        )


def _knobs(
    where: str,
    backend: str,
    rows: int,
    page_size: int,
    head_dim: int,
    max_pages: int,
    pages_per_compute_block: int | None,
    block_rows: int | None,
    itemsize: int,
) -> tuple[int, int]:
    """Checked (pages_per_block, block_rows) for a Pallas backend."""
    if backend == "pallas_gpu":
        if not _is_pow2(head_dim) or head_dim < 16:
            raise ValueError(f"{where}: the GPU kernel needs head_dim a power of two >= 16, got {head_dim}")
        if not _is_pow2(page_size):
            raise ValueError(f"{where}: the GPU kernel needs page_size a power of two, got {page_size}")
        ppb = (
            max(1, _GPU_BLOCK_TOKENS // page_size)
            if pages_per_compute_block is None
            else pages_per_compute_block
        )
        if not _is_pow2(ppb) or ppb * page_size < 16:
            raise ValueError(
                f"{where}: the GPU kernel needs pages_per_compute_block a power of two with "
                f"pages_per_compute_block * page_size >= 16, got {ppb} pages of {page_size}"
            )
        br = min(_GPU_MAX_BLOCK_ROWS, max(16, _next_pow2(rows))) if block_rows is None else block_rows
        if not _is_pow2(br) or br < 16:
            raise ValueError(f"{where}: the GPU kernel needs block_rows a power of two >= 16, got {br}")
        return ppb, br
    # Rows of one (8, 128) VMEM tile: 8 for 4-byte types, 16 for bfloat16 (packed in pairs).
    sublanes = 8 * max(1, 4 // itemsize)
    if page_size % sublanes != 0:
        raise ValueError(
            f"{where}: the TPU kernel needs page_size a multiple of {sublanes} for {itemsize}-byte data, "
            f"got {page_size}"
        )
    ppb = (
        max(1, _TPU_BLOCK_TOKENS // page_size) if pages_per_compute_block is None else pages_per_compute_block
    )
    if ppb < 1:
        raise ValueError(f"{where}: pages_per_compute_block must be >= 1, got {ppb}")
    if block_rows is None:
        # Whole tiles of rows: a query block of 1-7 rows would need a layout Mosaic may reject.
        br = -(-min(rows, _TPU_MAX_BLOCK_ROWS) // sublanes) * sublanes
    elif block_rows % sublanes != 0:
        raise ValueError(
            f"{where}: the TPU kernel needs block_rows a multiple of {sublanes}, got {block_rows}"
        )
    else:
        br = block_rows
    # A compute block wider than the block table would only re-read the last page.
    return min(ppb, max_pages), br


@functools.partial(
    jax.jit,
    static_argnames=("backend", "scale", "pages_per_block", "block_rows", "interpret", "sliding_window"),
)
def _attention_rows(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    seq_lens: jax.Array,
    q_lens: jax.Array,
    block_tables: jax.Array,
    *,
    backend: str,
    scale: float,
    pages_per_block: int,
    block_rows: int,
    interpret: bool,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
) -> jax.Array:
    """q: [batch, chunk, num_heads, head_dim] -> [batch, chunk, num_heads, head_dim] via a kernel.

    With ``layer``, the pages carry a leading layer axis that the kernel indexes itself; with
    ``new_k``/``new_v`` (decode, chunk 1), ``seq_lens`` counts cached tokens and the newest
    token joins the softmax beside them.
    """
    batch, chunk, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[-4]
    group = num_heads // num_kv_heads
    rows = chunk * group
    q_rows = q.reshape(batch, chunk, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim)
    padded_rows = -(-rows // block_rows) * block_rows
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    kernel = paged_attention_rows_tpu if backend == "pallas_tpu" else paged_attention_rows_gpu
    out: jax.Array = kernel(
        q_rows,
        k_pages,
        v_pages,
        seq_lens,
        q_lens,
        block_tables,
        group=group,
        scale=scale,
        pages_per_block=pages_per_block,
        block_rows=block_rows,
        interpret=interpret,
        sliding_window=sliding_window,
        layer=layer,
        new_k=new_k,
        new_v=new_v,
    )
    out = out[:, :, :rows].reshape(batch, num_kv_heads, chunk, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, chunk, num_heads, head_dim)


def _settle(out: jax.Array, backend: str, interpret: bool) -> jax.Array:
    """Wait for an eager TPU-interpret result before the caller can dispatch more work.

    TPU interpret mode simulates the chip with host callbacks that themselves run JAX ops
    on the CPU device. If the caller enqueues another computation while the kernel runs,
    the callbacks' ops queue behind it and both wait forever (observed as a rare hang in
    the test grid). Under an outer trace nothing runs yet, so there is nothing to wait for.
    """
    if backend == "pallas_tpu" and interpret and not isinstance(out, jax.core.Tracer):
        jax.block_until_ready(out)
    return out


_paged_attention_xla = jax.jit(paged_attention_xla, static_argnames=("scale", "sliding_window"))
_paged_attention_cpu = jax.jit(paged_attention_cpu, static_argnames=("scale", "sliding_window"))
_paged_prefill_xla = jax.jit(paged_prefill_attention_reference, static_argnames=("scale",))


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
    backend: Backend = "auto",
    pages_per_compute_block: int | None = None,
    block_rows: int | None = None,
    interpret: bool = False,
    sliding_window: int | None = None,
    new_k: jax.Array | None = None,
    new_v: jax.Array | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Decode attention (one query token per sequence) over a paged KV cache, grouped-query heads.

    Args:
      q: ``[batch, num_heads, head_dim]``, the query of each sequence's newest token.
      k_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``, or
        ``[num_layers, num_kv_heads, total_pages, page_size, head_dim]`` with ``layer`` given.
      v_pages: like ``k_pages``.
      lengths: ``[batch] int32``, tokens in the cache per sequence (>= 1), including the
        newest token, whose K/V must already be written (``write_kv``); without that token
        (>= 0) when ``new_k``/``new_v`` are given.
      block_tables: ``[batch, max_pages_per_seq] int32``; entries past a sequence's last page
        are never read.
      scale: softmax temperature; ``1 / sqrt(head_dim)`` when None.
      backend: ``auto``, ``cpu``, ``xla``, ``pallas_tpu`` or ``pallas_gpu`` (see module docs).
      pages_per_compute_block: pages per kernel step (TPU: per DMA block, clipped to
        ``max_pages_per_seq``; GPU: a power of two); a per-backend default when None.
      block_rows: query rows (query heads of one KV head) per program; default covers the group.
      interpret: run the named Pallas kernel in interpret mode (CPU).
      sliding_window: when given, each query sees only its last ``sliding_window`` tokens
        (itself included), on every backend (``ModelConfig.sliding_window``).
      new_k, new_v: ``[batch, num_kv_heads, head_dim]``, the newest token's K/V, not in the
        cache: it joins the softmax directly, and the caller writes it afterwards (the engine
        writes every layer's at once, outside its layer scan).
      layer: int32 scalar (traced is fine) choosing the layer of a 5-D cache; every backend
        reads that layer's pages in place (the Pallas kernels address them themselves), so
        a layer is never sliced out, which would copy it.

    Returns:
      ``[batch, num_heads, head_dim]`` in ``q``'s dtype; accumulation in float32.

    Raises:
      ValueError: inconsistent shapes or dtypes (the message prints them), bad knobs, or a
        backend that cannot run here; lengths out of range when they are concrete.
    """
    where = "paged_attention"
    check_decode_arguments(
        where, q, k_pages, v_pages, lengths, block_tables, new_k=new_k, new_v=new_v, layer=layer,
        sliding_window=sliding_window, one_dtype=True,
    )  # fmt: skip
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size, max_pages = k_pages.shape[-4], k_pages.shape[-2], block_tables.shape[1]
    _check_length_values(where, lengths, max_pages * page_size, None, minimum=0 if new_k is not None else 1)
    scale = default_scale(head_dim) if scale is None else float(scale)
    chosen = resolve_backend(backend, interpret)
    if chosen == "cpu" and k_pages.dtype != jnp.float32:
        if backend == "cpu":
            report = shape_report(q=q, k_pages=k_pages, v_pages=v_pages)
            raise ValueError(f"{where}: backend='cpu' reads a float32 cache only (got {report})")
        chosen = "xla"
    if chosen in ("xla", "cpu"):
        run = _paged_attention_xla if chosen == "xla" else _paged_attention_cpu
        out: jax.Array = run(
            q, k_pages, v_pages, lengths, block_tables, scale=scale, sliding_window=sliding_window,
            new_k=new_k, new_v=new_v, layer=layer,
        )  # fmt: skip
        return out
    group = num_heads // num_kv_heads
    ppb, br = _knobs(
        where,
        chosen,
        group,
        page_size,
        head_dim,
        max_pages,
        pages_per_compute_block,
        block_rows,
        q.dtype.itemsize,
    )
    out = _attention_rows(
        q[:, None],
        k_pages,
        v_pages,
        lengths,
        jnp.ones_like(lengths),
        block_tables,
        backend=chosen,
        scale=scale,
        pages_per_block=ppb,
        block_rows=br,
        interpret=interpret,
        sliding_window=sliding_window,
        layer=None if layer is None else jnp.asarray(layer, jnp.int32),
        new_k=new_k,
        new_v=new_v,
    )
    return _settle(out[:, 0], chosen, interpret)


def paged_prefill_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    seq_lens: jax.Array,
    q_lens: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
    backend: Backend = "auto",
    pages_per_compute_block: int | None = None,
    block_rows: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a chunk of new tokens per sequence over the paged cache (chunked prefill).

    Each sequence brings up to ``chunk`` new tokens whose K/V are already written to the
    cache (``write_kv``); they attend to the cached prefix and causally to each other. A
    whole prompt is one chunk with ``q_lens == seq_lens``; a long prompt can be fed in
    several chunks, and prefill and decode rows can share one call (``q_lens == 1``).

    Args:
      q: ``[batch, chunk, num_heads, head_dim]``; rows at or past ``q_lens[b]`` are padding.
      k_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      v_pages: ``[num_kv_heads, total_pages, page_size, head_dim]``.
      seq_lens: ``[batch] int32``, tokens in the cache after the chunk (>= 1); query row ``j``
        sits at position ``seq_lens[b] - q_lens[b] + j``.
      q_lens: ``[batch] int32``, new tokens per sequence (``0 <= q_lens <= min(chunk, seq_lens)``).
      block_tables: ``[batch, max_pages_per_seq] int32``.
      scale, backend, pages_per_compute_block, block_rows, interpret: as in ``paged_attention``;
        ``block_rows`` counts (chunk token, query head) rows per program.

    Returns:
      ``[batch, chunk, num_heads, head_dim]`` in ``q``'s dtype; padding rows are zero.

    Raises:
      ValueError: as ``paged_attention``.
    """
    where = "paged_prefill_attention"
    report = shape_report(
        q=q, k_pages=k_pages, v_pages=v_pages, seq_lens=seq_lens, q_lens=q_lens, block_tables=block_tables
    )
    if q.ndim != 4 or q.shape[1] < 1:
        raise ValueError(f"{where}: q must be [batch, chunk>=1, num_heads, head_dim] (got {report})")
    batch, chunk, num_heads, head_dim = q.shape
    check_cache_and_tables(where, num_heads, head_dim, q.dtype, k_pages, v_pages, batch, block_tables, report)
    check_lengths(where, "seq_lens", seq_lens, batch, report)
    check_lengths(where, "q_lens", q_lens, batch, report)
    page_size, max_pages = k_pages.shape[2], block_tables.shape[1]
    _check_length_values(where, seq_lens, max_pages * page_size, q_lens)
    qls = _concrete(q_lens)
    if qls is not None and qls.size and qls.max() > chunk:
        raise ValueError(f"{where}: q_lens must not exceed chunk={chunk}, got {qls.tolist()}")
    scale = default_scale(head_dim) if scale is None else float(scale)
    chosen = resolve_backend(backend, interpret)
    if chosen in ("xla", "cpu"):  # the CPU has no prefill kernel of its own
        prefill: jax.Array = _paged_prefill_xla(
            q, k_pages, v_pages, seq_lens, q_lens, block_tables, scale=scale
        )
        return prefill
    rows = chunk * (num_heads // k_pages.shape[0])
    ppb, br = _knobs(
        where,
        chosen,
        rows,
        page_size,
        head_dim,
        max_pages,
        pages_per_compute_block,
        block_rows,
        q.dtype.itemsize,
    )
    out = _attention_rows(
        q,
        k_pages,
        v_pages,
        seq_lens,
        q_lens,
        block_tables,
        backend=chosen,
        scale=scale,
        pages_per_block=ppb,
        block_rows=br,
        interpret=interpret,
    )
    return _settle(out, chosen, interpret)
