"""Forward+backward throughput of a SmolLM2-135M-shaped model at sequence 512, reported as a
fraction of this machine's float32 matmul peak measured in the same run (model FLOPs
utilisation, MFU)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from rlax_model import ModelConfig, init_params, logprobs
from rlax_model.roofline import matmul_peak_flops

SEQ = 512
BATCH = 1


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def train_flops_per_token(config: ModelConfig, seq: int) -> float:
    """6 x matmul parameters (forward + backward) plus attention score/value matmuls."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    matmul_params = config.num_layers * per_layer + h * config.vocab_size
    attention = 12 * config.num_layers * q * seq
    return 6.0 * matmul_params + attention


def test_forward_backward_mfu(benchmark):
    config = ModelConfig.smollm2_135m()
    params = init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, config.vocab_size, jnp.int32)

    @jax.jit
    def step(params, tokens):
        return jax.value_and_grad(lambda p: -logprobs(p, tokens, config=config, chunk_size=128).mean())(
            params
        )

    jax.block_until_ready(step(params, tokens))  # compile outside the timed rounds
    peak_before = matmul_peak_flops()
    benchmark.pedantic(lambda: jax.block_until_ready(step(params, tokens)), rounds=2, iterations=1)
    peak = max(peak_before, matmul_peak_flops())
    seconds = benchmark.stats.stats.min
    tokens_per_s = BATCH * SEQ / seconds
    achieved = tokens_per_s * train_flops_per_token(config, SEQ)
    ratio = achieved / peak
    benchmark.extra_info.update(
        tokens_per_s=tokens_per_s, model_flops_per_s=achieved, matmul_peak_flops_per_s=peak, mfu=ratio
    )
    print(
        f"\nSmolLM2-135M fwd+bwd, seq {SEQ}: {tokens_per_s:.1f} tokens/s = {achieved / 1e9:.1f} GFLOP/s; "
        f"f32 matmul peak {peak / 1e9:.1f} GFLOP/s; ratio (MFU) {ratio:.3f}"
    )
    assert 0 < ratio
