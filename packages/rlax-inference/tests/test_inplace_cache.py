"""Decode never copies the KV cache, on every backend (the Pallas kernels in interpret mode).

The compiled decode step's memory report must show temporaries far below the cache's size
and the cache output aliasing the donated cache input. Threading the cache through the
model's layer scan (what the Pallas path did before it read a layer of the 5-D cache
through a scalar-prefetched index) cost 1.5-2.1x the cache in temporaries on XLA:CPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import CONFIG, PARAMS

import rlax_kernels
from rlax_inference import model_runner as mr
from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.sequence import SamplingParams
from rlax_kernels.paged_attention.testing import make_paged_case

BACKENDS = ["cpu", "xla", "pallas_gpu", "pallas_tpu"]


NUM_BLOCKS, BLOCK_SIZE = 512, 16


def _cache_shape() -> tuple[int, ...]:
    return (CONFIG.num_layers, CONFIG.num_kv_heads, NUM_BLOCKS + 1, BLOCK_SIZE, CONFIG.head_dim)


def runner_dtype(backend: str) -> str:
    return (
        "f32" if backend in ("cpu", "xla") else {"float32": "f32", "bfloat16": "bf16"}[CONFIG.compute_dtype]
    )


def _decode_memory(backend: str, num_steps: int):  # type: ignore[no-untyped-def]
    runner = mr.ModelRunner(
        CONFIG, PARAMS, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=256,
        attention=backend, interpret=backend.startswith("pallas"),
    )  # fmt: skip
    rows, width = 8, 4
    batch = mr.ModelRunner._sampling_batch([(1.0, 1.0, 0, 0, 0, 0)] * rows, rows)
    args = (
        runner.params,
        runner.cache,
        np.zeros(rows, np.int32),
        np.zeros((num_steps, rows), np.int32),
        np.ones((rows, width), np.int32),
        np.ones(rows, np.int32),
        batch,
    )
    compiled = mr._decode_steps.lower(
        *args, config=CONFIG, attention=runner.attention, interpret=runner.interpret, use_filters=False,
        num_top=0,
    ).compile()  # fmt: skip
    cache_bytes = sum(x.nbytes for x in runner.cache.values())
    return compiled, cache_bytes


@pytest.mark.parametrize(
    "backend,num_steps",
    [(b, 1) for b in BACKENDS]
    + [
        pytest.param("pallas_gpu", 3, marks=pytest.mark.slow),
        pytest.param("pallas_tpu", 3, marks=pytest.mark.slow),
    ],
)
def test_decode_step_updates_the_cache_in_place(backend, num_steps):
    compiled, cache_bytes = _decode_memory(backend, num_steps)
    mem = compiled.memory_analysis()
    assert cache_bytes > 4 * 2**20  # large enough that a copy would dominate everything else
    assert mem.temp_size_in_bytes < cache_bytes / 8, (mem.temp_size_in_bytes, cache_bytes)
    # The donated cache input is the cache output: nothing is allocated for it.
    assert mem.alias_size_in_bytes >= cache_bytes, (mem.alias_size_in_bytes, cache_bytes)
    # ... and the program says so: the parameters of the cache's shape (its two tensors) alias outputs.
    header = compiled.as_text().split("\n", 1)[0]
    aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}, may-alias\)", header)}
    layout = re.sub(
        r"/\*index=\d+\*/", "", header.split("entry_computation_layout={(", 1)[1].split(")->", 1)[0]
    )
    params = re.findall(r"(\w+\[[\d,]*\])", layout)
    cache_shape = "{}[{}]".format(runner_dtype(backend), ",".join(map(str, _cache_shape())))
    cache_params = {i for i, shape in enumerate(params) if shape == cache_shape}
    assert len(cache_params) == 2 and cache_params <= aliased, (cache_shape, params, aliased)


def _engine(attention: str, **kw) -> LLMEngine:  # type: ignore[no-untyped-def]
    cfg = dict(
        block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=128,
        eos_token_ids=(), attention=attention, attention_interpret=attention.startswith("pallas"),
    )  # fmt: skip
    cfg.update(kw)
    return LLMEngine(CONFIG, PARAMS, EngineConfig(**cfg))


# The TPU kernel's interpret mode emulates its DMAs step by step: a few tokens only.
@pytest.mark.parametrize(
    "backend,num_steps",
    [
        ("pallas_gpu", 1),
        pytest.param("pallas_gpu", 3, marks=pytest.mark.slow),
        pytest.param("pallas_tpu", 1, marks=pytest.mark.slow),
    ],
)
def test_pallas_decode_equals_the_fused_cpu_path(backend, num_steps):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, CONFIG.vocab_size, size=n)] for n in (5, 17, 9)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=11)
    want = _engine("cpu", num_decode_steps=num_steps).generate(prompts, params)
    got = _engine(backend, num_decode_steps=num_steps).generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert wc.tokens == gc.tokens
            np.testing.assert_allclose(gc.logprobs, wc.logprobs, rtol=0, atol=2e-5)


def test_kernel_reads_a_layer_in_place_with_the_new_token():
    """The Pallas kernels' layer index and new K/V equal writing the token and slicing the layer."""
    lengths = [1, 16, 33, 7]
    case = make_paged_case(5, seq_lens=lengths, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
    rng = np.random.default_rng(1)
    new_k = jnp.asarray(rng.normal(size=(4, 2, 16)), jnp.float32)
    new_v = jnp.asarray(rng.normal(size=(4, 2, 16)), jnp.float32)
    cached = case.seq_lens - 1
    tables, last = np.asarray(case.block_tables), np.asarray(cached)
    slots = jnp.asarray(tables[np.arange(4), last // 8] * 8 + last % 8)
    kw, vw = rlax_kernels.write_kv(case.k_pages, case.v_pages, new_k, new_v, slots)
    want = rlax_kernels.paged_attention_reference(case.q, kw, vw, case.seq_lens, case.block_tables)
    poison = jnp.full_like(case.k_pages, jnp.nan)
    k5, v5 = jnp.stack([poison, case.k_pages, poison]), jnp.stack([poison, case.v_pages, poison])
    for backend in ("pallas_gpu", "pallas_tpu"):
        got = jax.jit(
            lambda q, k, v, n, t, nk, nv, layer, b=backend: rlax_kernels.paged_attention(
                q, k, v, n, t, new_k=nk, new_v=nv, layer=layer, backend=b, interpret=True
            )
        )(case.q, k5, v5, cached, case.block_tables, new_k, new_v, jnp.int32(1))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_prefill_chunk_step_reads_the_cache_in_place():
    """Chunked prefill reads the cached context through the block tables and writes after the scan:
    its temporaries do not grow with the cache (measured 1.96 MiB for 8 and 32 MiB caches)."""
    runner = mr.ModelRunner(
        CONFIG, PARAMS, num_blocks=4096, block_size=16, max_num_seqs=8, max_model_len=256, attention="cpu"
    )
    rows, length, width = 4, 64, runner.prefill_width
    zeros = np.zeros((rows, length), np.int32)
    compiled = mr._prefill_step.lower(
        runner.params, runner.cache, zeros, np.zeros(rows, np.int32), np.ones(rows, np.int32), zeros,
        np.zeros((rows, width), np.int32), config=CONFIG,
    ).compile()  # fmt: skip
    mem = compiled.memory_analysis()
    cache_bytes = sum(x.nbytes for x in runner.cache.values())
    assert mem.temp_size_in_bytes < cache_bytes / 8, (mem.temp_size_in_bytes, cache_bytes)
    assert mem.alias_size_in_bytes >= cache_bytes
