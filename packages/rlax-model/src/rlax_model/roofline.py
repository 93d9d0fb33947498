"""The physical limit that benchmarks report against: this machine's matmul peak.

Model, trainer and engine benchmarks measure it in the same run as their own figures
and report achieved FLOP/s as a fraction of it.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

__all__ = ["matmul_peak_flops"]


def matmul_peak_flops(dtype: jnp.dtype = jnp.float32, *, n: int = 2048, repeats: int = 5) -> float:
    """Best observed FLOP/s of an `[n, n] @ [n, n]` matmul in `dtype` (float32 accumulation)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    matmul(a, b).block_until_ready()  # compile outside the timed repeats
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best
