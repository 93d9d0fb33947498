"""Paged decode attention: our kernels vs the XLA reference vs the paged attention JAX ships.

Collected by ``nox -s bench``. Each implementation is timed by pytest-benchmark; the
reference and JAX's kernel are timed again in the same test so every row prints its
ratios, and a last benchmark prints the whole comparison table. Achieved bandwidth is
reported as a fraction of the device's peak on TPU/GPU; on the CPU the rows are labelled
``interpret`` (Pallas interpreter) or ``xla`` (the compiled reference).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from rlax_kernels import paged_attention, paged_attention_reference
from rlax_kernels.paged_attention import bench


@pytest.fixture(scope="module")
def decode_setup():
    config = bench.default_config()
    case = bench.make_case(config)
    impls = {impl.name: impl for impl in bench.implementations(case, config)}
    expected = np.asarray(impls["xla_reference"].fn(), np.float32)
    return config, case, impls, expected


@pytest.mark.parametrize("name", bench.implementation_names())
def test_paged_decode(benchmark, decode_setup, name: str) -> None:
    config, case, impls, expected = decode_setup
    impl = impls[name]
    out = np.asarray(impl.fn(), np.float32)  # compile outside the timed rounds
    # JAX's TPU kernel in interpret mode drifts by ~1e-3; ours and the reference agree tightly.
    tolerance = 2e-2 if config.dtype == "bfloat16" or name.startswith("jax_") else 1e-4
    np.testing.assert_allclose(out, expected, atol=tolerance, rtol=tolerance)
    rounds = 3 if impl.mode == "interpret" else 20
    benchmark.pedantic(lambda: jax.block_until_ready(impl.fn()), rounds=rounds, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    reference = bench.median_seconds(impls["xla_reference"].fn, iters=rounds)
    gbps = case.useful_bytes / seconds / 1e9
    peak = bench.peak_bandwidth_gbps(jax.devices()[0].device_kind)
    benchmark.extra_info.update(
        mode=impl.mode,
        gbps=gbps,
        peak_fraction=None if peak is None or impl.mode == "interpret" else gbps / peak,
        reference_over_this=reference / seconds,
    )
    line = f"\n{name} [{impl.mode}]: {seconds * 1e3:.3f} ms, {gbps:.2f} GB/s"
    if peak is not None and impl.mode != "interpret":
        line += f" = {gbps / peak:.1%} of {peak:.0f} GB/s peak"
    line += f"; xla_reference/this = {reference / seconds:.2f}x"
    peer = name.replace("rlax_", "jax_")
    if name.startswith("rlax_") and peer in impls:
        peer_seconds = bench.median_seconds(impls[peer].fn, iters=rounds)
        benchmark.extra_info["jax_over_this"] = peer_seconds / seconds
        line += f"; {peer}/this = {peer_seconds / seconds:.2f}x"
    print(line)


def test_paged_decode_table(benchmark) -> None:
    config = bench.default_config()
    results = benchmark.pedantic(lambda: bench.run(config), rounds=1, iterations=1)
    print("\n" + bench.format_table(results, config))
    for r in results:
        benchmark.extra_info[r.name] = {"mode": r.mode, "ms": r.seconds * 1e3, "gbps": r.gbps}


# The decode batches of the engine benchmark (64 prompts x 8 samples, contexts around 192
# tokens, float32) with SmolLM2-135M's heads and the tiny test model's: the native CPU kernel
# (what the CPU engine runs) beside the XLA decode path and the gather-everything reference,
# all compiled, same inputs, same run.
ENGINE_SHAPES = {
    "smollm2": bench.DecodeBenchConfig(
        batch=512, num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, mean_length=192, dtype="float32"
    ),
    "tiny": bench.DecodeBenchConfig(
        batch=512, num_heads=4, num_kv_heads=2, head_dim=16, page_size=16, mean_length=192, dtype="float32"
    ),
}


@pytest.mark.parametrize("shape", sorted(ENGINE_SHAPES))
def test_cpu_decode_at_engine_shape(benchmark, shape: str) -> None:
    config = ENGINE_SHAPES[shape]
    case = bench.make_case(config)
    args = (case.q, case.k_pages, case.v_pages, case.lengths, case.block_tables)
    native = jax.default_backend() == "cpu"
    ours = jax.jit(functools.partial(paged_attention, backend="cpu" if native else "xla"))
    xla = jax.jit(functools.partial(paged_attention, backend="xla"))
    reference = jax.jit(paged_attention_reference)
    expected = np.asarray(reference(*args))
    np.testing.assert_allclose(np.asarray(ours(*args)), expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(xla(*args)), expected, atol=1e-5, rtol=1e-5)
    benchmark.pedantic(lambda: jax.block_until_ready(ours(*args)), rounds=10, warmup_rounds=1)
    seconds = benchmark.stats.stats.median
    xla_seconds = bench.median_seconds(lambda: xla(*args), iters=10)
    reference_seconds = bench.median_seconds(lambda: reference(*args), iters=10)
    gbps = case.useful_bytes / seconds / 1e9
    benchmark.extra_info.update(
        xla_over_this=xla_seconds / seconds, reference_over_this=reference_seconds / seconds, gbps=gbps
    )
    print(
        f"\nengine shape {shape} {config}: {'native CPU kernel' if native else 'XLA path'} "
        f"{seconds * 1e3:.2f} ms ({gbps:.2f} GB/s useful) vs XLA decode path {xla_seconds * 1e3:.2f} ms "
        f"({xla_seconds / seconds:.2f}x) vs xla_reference {reference_seconds * 1e3:.2f} ms "
        f"({reference_seconds / seconds:.2f}x)"
    )
