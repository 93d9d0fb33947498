"""Building blocks of the decoder: RMSNorm, rotary position embeddings, SwiGLU MLP."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlax_model.config import LinearRopeScaling, Llama3RopeScaling, ModelConfig


def ordered_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in one fixed order: [..., n] -> [..., 1].

    Pairwise halving (element i plus element i + n/2, an odd last element carried along),
    written as elementwise adds, which XLA never reassociates. `jnp.sum` leaves the order to
    the compiler, and XLA:CPU picks it by the whole array's shape: a row's sum then changes
    with how many other rows are reduced with it (measured: RMSNorm over 64 features, a row
    differed by 4.8e-7 between 48 and 96 rows), which breaks batch invariance.
    """
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        head = x[..., :half] + x[..., half : 2 * half]
        x = jnp.concatenate([head, x[..., 2 * half :]], axis=-1) if n % 2 else head
    return x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, dtype: Any = None) -> jax.Array:
    """RMSNorm over the last axis: statistics and scale in float32, one rounding to `dtype`.

    x: [..., dim]; weight: [dim]. Returns [..., dim] in `dtype` (default x.dtype).
    The mean square is an `ordered_sum`: a token's norm does not depend on its batch.
    """
    x32 = x.astype(jnp.float32)
    mean_square = ordered_sum(x32 * x32) / jnp.float32(x.shape[-1])
    normed = x32 * jax.lax.rsqrt(mean_square + eps)
    return (normed * weight.astype(jnp.float32)).astype(dtype or x.dtype)


def rope_inv_frequencies(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies after scaling: [head_dim // 2] float32 (host constant)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = config.rope_scaling
    if isinstance(scaling, LinearRopeScaling):
        inv_freq = inv_freq / scaling.factor
    elif isinstance(scaling, Llama3RopeScaling):
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2.0 * math.pi / inv_freq
        # Short wavelengths keep their frequency, long ones are divided by `factor`, and the
        # band in between is blended linearly in 1/wavelength.
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1.0 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = np.where(
            wavelen > low_wavelen,
            inv_freq / scaling.factor,
            np.where(wavelen < high_wavelen, inv_freq, blended),
        )
    return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for `positions`.

    positions: [batch, seq] int32. Returns (cos, sin), each [batch, seq, head_dim // 2] float32.
    """
    inv_freq = jnp.asarray(rope_inv_frequencies(config))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` with the half-split (HF "rotate_half") layout.

    x: [batch, seq, heads, head_dim]; cos/sin: [batch, seq, head_dim // 2] float32.
    Returns [batch, seq, heads, head_dim] in x.dtype (rotation computed in float32).
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


# XLA:CPU multiplies a matrix of few rows with another kernel than a tall one, and the two
# round differently (measured on [rows, in] @ [in, out] float32: every row count up to 32
# differs from 300 rows for SmolLM2's widths, up to 50 for 32-64 wide ones; none from 51
# on). Under `padded_matmul_rows(MIN_MATMUL_ROWS)` matmuls with fewer rows are padded to this
# many, so that a token's projection does not depend on how many tokens share the matmul.
# The trainer's `batch_invariant` used to; it now compiles with `ALIGNED_COMPILER_OPTIONS`
# instead (no kernel switch from 2 rows on) and pads only to `ALIGNED_MIN_ROWS`. Not by
# default: the engine decodes a handful of rows, and padding 8 rows to 64 made SmolLM2's
# projections 1.8-2.3x slower (measured).
MIN_MATMUL_ROWS = 64

# The compiler options of programs whose float32 results must agree to the bit with other
# programs' (the engine's and the trainer's in aligned mode: `rlax_inference.EngineConfig.aligned`,
# `trainer.batch_invariant`). XLA:CPU (jax 0.10) lowers float32 and bfloat16 matmuls to a
# YNNPACK fusion whose rounding of a row depends on the row count (measured on
# [rows, 576] @ [576, 1536]: up to 7.6e-5 apart for 1-32 rows against 33 or more) and, for
# attention's batched matmuls, on the query count at every size; with YNNPACK off, XLA's
# Eigen dot gives every row the same bits for any row count from 2 on (one row takes a
# matrix-vector path that rounds otherwise: `row_matmul` then pads to 2 rows, see
# `ALIGNED_MIN_ROWS`). Other backends ignore the option.
ALIGNED_COMPILER_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}
ALIGNED_MIN_ROWS = 2
_trace_settings = threading.local()


@contextlib.contextmanager
def padded_matmul_rows(rows: int) -> Iterator[None]:
    """While tracing inside this block (this thread), `row_matmul` pads to `rows` rows (0: never)."""
    previous = getattr(_trace_settings, "min_rows", 0)
    _trace_settings.min_rows = rows
    try:
        yield
    finally:
        _trace_settings.min_rows = previous


def row_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] float32 (operands as given); inside
    `padded_matmul_rows(n)`, over at least n rows (zero rows added and dropped)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    min_rows = getattr(_trace_settings, "min_rows", 0)
    if n < min_rows:
        rows = jnp.pad(rows, ((0, min_rows - n), (0, 0)))
    y = jnp.einsum("ri,io->ro", rows, w, preferred_element_type=jnp.float32)[:n]
    return y.reshape(*lead, w.shape[-1])


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, dtype: Any = None) -> jax.Array:
    """x @ w (+ b): operands in x.dtype, float32 accumulation, result in `dtype` (default x.dtype).

    x: [..., in]; w: [in, out].
    """
    y = row_matmul(x, w.astype(x.dtype))
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(dtype or x.dtype)


def swiglu_mlp(x: jax.Array, layer: dict[str, Any]) -> jax.Array:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). x: [batch, seq, hidden] (compute dtype).

    The matmuls take x.dtype operands; gate, up and their product stay float32 and are
    rounded once, as the input of `down`. Returns float32 (the residual stream's dtype).
    """
    gate = linear(x, layer["gate_proj"], dtype=jnp.float32)
    up = linear(x, layer["up_proj"], dtype=jnp.float32)
    return linear((jax.nn.silu(gate) * up).astype(x.dtype), layer["down_proj"], dtype=jnp.float32)
