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


# The compiler options of programs whose float32 results must agree to the bit with other
# programs' (the engine's and the trainer's in aligned mode: `rlax_inference.EngineConfig.aligned`,
# `trainer.batch_invariant`). XLA:CPU (jax 0.10) lowers float32 and bfloat16 matmuls to a
# YNNPACK fusion whose rounding of a row depends on the row count (measured on
# [rows, 576] @ [576, 1536]: up to 7.6e-5 apart for 1-32 rows against 33 or more) and, for
# attention's batched matmuls, on the query count at every size; with YNNPACK off XLA calls
# its Eigen/oneDNN dot, which still rounds a row by the row count on some CPUs (below), so
# aligned programs also multiply in `ALIGNED_ROW_BLOCK`-row blocks. Other backends ignore
# the option.
ALIGNED_COMPILER_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}

# A row's bits from XLA:CPU's dot depend on how many rows share the matmul. On an AVX-512
# CPU (YNNPACK off) only a single row differed; on an AVX2 CPU (AMD EPYC, measured
# 2026-12-03) the kernel works through six rows at a time, the one to three rows after the
# last full group round otherwise (up to 2.7e-5 on [r, 576] @ [576, 1536]), and the split
# into cache blocks moves with the row count (a [r, 576] @ [576, 192] row differed at every
# count from 25 to 700 against 24 rows). Multiplying in blocks of exactly this many rows
# (a loop over row blocks, the last zero-padded) gives every row the same bits whatever
# the row count and the row's place, on both CPUs (measured on 1-400 rows at 7 offsets,
# six shapes). 24 = four of AVX2's six-row groups, three of AVX-512's eight; a block of 6
# rows rounded apart from one of 24, so the engine and the trainer must share the number.
# Cost: 1.4-2.2x a single matmul's time on 4,096 rows (the weights are re-packed per
# block), and the engine's decode pads its few rows up to 24; only aligned programs pay it.
ALIGNED_ROW_BLOCK = 24
_trace_settings = threading.local()


@contextlib.contextmanager
def matmul_row_blocks(rows: int) -> Iterator[None]:
    """While tracing inside this block (this thread), `row_matmul` multiplies in blocks of
    exactly `rows` rows (0: one matmul over all rows)."""
    previous = getattr(_trace_settings, "row_block", 0)
    _trace_settings.row_block = rows
    try:
        yield
    finally:
        _trace_settings.row_block = previous


def row_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] float32 (operands as given); inside
    `matmul_row_blocks(n)`, as a loop over blocks of exactly n rows (zero rows added and
    dropped), so that a row's bits do not depend on the other rows."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    block: int = getattr(_trace_settings, "row_block", 0)

    def matmul(part: jax.Array) -> jax.Array:
        return jnp.einsum("ri,io->ro", part, w, preferred_element_type=jnp.float32)

    if block:
        count = -(-n // block)
        blocks = jnp.pad(rows, ((0, count * block - n), (0, 0))).reshape(count, block, -1)
        looped: jax.Array = jax.lax.map(matmul, blocks)
        y = looped.reshape(count * block, -1)[:n]
    else:
        y = matmul(rows)
    return y.reshape(*lead, w.shape[-1])


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, dtype: Any = None) -> jax.Array:
    """x @ w (+ b): operands in x.dtype, float32 accumulation, result in `dtype` (default x.dtype).

    x: [..., in]; w: [in, out].
    """
    y = row_matmul(x, w.astype(x.dtype))
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(dtype or x.dtype)


def project(
    x: jax.Array, layer: dict[str, Any], name: str, bias: jax.Array | None = None, *, dtype: Any
) -> jax.Array:
    """The layer's linear map `name` of x, with its low-rank adapter when the layer has one.

    x: [..., in] (compute dtype); layer[name]: [in, out]; bias: [out] or None. With
    `layer["lora"][name]` = {"a": [in, r], "b": [r, out]} (B times the adapter's scale:
    `rlax_model.lora.with_adapters`) it is x @ W + (x @ A) @ B, the adapter's product added
    in float32 before the one rounding to `dtype`; without, exactly `linear`.
    Returns [..., out] in `dtype`.
    """
    adapter: dict[str, jax.Array] | None = layer.get("lora", {}).get(name)
    if adapter is None:
        return linear(x, layer[name], bias, dtype=dtype)
    y = linear(x, layer[name], bias, dtype=jnp.float32)
    low = row_matmul(x, adapter["a"].astype(x.dtype)).astype(x.dtype)  # [..., r]
    return (y + row_matmul(low, adapter["b"].astype(x.dtype))).astype(dtype)


def swiglu_mlp(x: jax.Array, layer: dict[str, Any]) -> jax.Array:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). x: [batch, seq, hidden] (compute dtype).

    The matmuls take x.dtype operands; gate, up and their product stay float32 and are
    rounded once, as the input of `down`. Returns float32 (the residual stream's dtype).
    Each projection goes through `project` (its adapter applied when the layer has one).
    """
    gate = project(x, layer, "gate_proj", dtype=jnp.float32)
    up = project(x, layer, "up_proj", dtype=jnp.float32)
    return project((jax.nn.silu(gate) * up).astype(x.dtype), layer, "down_proj", dtype=jnp.float32)
