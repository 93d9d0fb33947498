"""The cache API used the way an engine uses it, checked against dense causal attention in numpy.

Two sequences get their prompts in chunks (one sequence idles in the second chunk), then
decode token by token; each step writes the new K/V with ``write_kv`` at slots computed by
``slots_from_positions`` and then attends. Every output must equal plain causal softmax
attention over the sequence's own tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_kernels import (
    paged_attention,
    paged_prefill_attention,
    slots_from_positions,
    write_kv,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 4, 2, 16, 8
PROMPTS = [5, 11]
DECODE_STEPS = 4
CHUNK = 6


def _dense_causal(q, k, v, t):
    """Attention of query token t over tokens 0..t; q,k,v: [tokens, heads or kv_heads, dim]."""
    group = NUM_HEADS // NUM_KV_HEADS
    out = np.zeros((NUM_HEADS, HEAD_DIM))
    for n in range(NUM_HEADS):
        scores = k[: t + 1, n // group] @ q[t, n] / np.sqrt(HEAD_DIM)
        w = np.exp(scores - scores.max())
        out[n] = (w / w.sum()) @ v[: t + 1, n // group]
    return out


@pytest.mark.parametrize("backend,interpret", [("xla", False), ("pallas_gpu", True), ("pallas_tpu", True)])
def test_chunked_prefill_then_decode_equals_dense_attention(backend: str, interpret: bool) -> None:
    rng = np.random.default_rng(0)
    total = [n + DECODE_STEPS for n in PROMPTS]
    q_all = [rng.standard_normal((n, NUM_HEADS, HEAD_DIM)).astype(np.float32) for n in total]
    k_all = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in total]
    v_all = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in total]

    max_pages = max(-(-n // PAGE_SIZE) for n in total)
    total_pages = 2 * max_pages + 1
    free = list(rng.permutation(total_pages))
    tables = np.zeros((2, max_pages), np.int32)
    for b in range(2):
        tables[b] = [free.pop() for _ in range(max_pages)]
    tables_j = jnp.asarray(tables)
    # Unwritten slots hold NaN: reading any of them would poison the result.
    k_pages = jnp.full((NUM_KV_HEADS, total_pages, PAGE_SIZE, HEAD_DIM), jnp.nan, jnp.float32)
    v_pages = jnp.full_like(k_pages, jnp.nan)
    knobs = {"backend": backend, "interpret": interpret}
    if backend != "xla":
        knobs["pages_per_compute_block"] = 2

    def write(tokens: list[tuple[int, int]]) -> None:
        """tokens: (sequence, position) pairs; padded to a fixed bucket of 2 * CHUNK with -1."""
        nonlocal k_pages, v_pages
        pad = 2 * CHUNK - len(tokens)
        seqs = [s for s, _ in tokens] + [0] * pad
        positions = jnp.asarray([p for _, p in tokens] + [-1] * pad, jnp.int32)
        slots = slots_from_positions(tables_j[jnp.asarray(seqs)], positions, PAGE_SIZE)
        new_k = np.zeros((2 * CHUNK, NUM_KV_HEADS, HEAD_DIM), np.float32)
        new_v = np.zeros_like(new_k)
        for i, (s, p) in enumerate(tokens):
            new_k[i], new_v[i] = k_all[s][p], v_all[s][p]
        k_pages, v_pages = write_kv(k_pages, v_pages, jnp.asarray(new_k), jnp.asarray(new_v), slots)

    # Prefill in two chunks: sequence 0 fits in the first and idles in the second.
    done = [0, 0]
    for _ in range(2):
        q_lens = [min(CHUNK, PROMPTS[b] - done[b]) for b in range(2)]
        write([(b, done[b] + j) for b in range(2) for j in range(q_lens[b])])
        q = np.zeros((2, CHUNK, NUM_HEADS, HEAD_DIM), np.float32)
        for b in range(2):
            q[b, : q_lens[b]] = q_all[b][done[b] : done[b] + q_lens[b]]
        seq_lens = [done[b] + q_lens[b] for b in range(2)]
        out = np.asarray(
            paged_prefill_attention(
                jnp.asarray(q),
                k_pages,
                v_pages,
                jnp.asarray(seq_lens),
                jnp.asarray(q_lens),
                tables_j,
                **knobs,
            )
        )
        for b in range(2):
            for j in range(q_lens[b]):
                t = done[b] + j
                np.testing.assert_allclose(
                    out[b, j], _dense_causal(q_all[b], k_all[b], v_all[b], t), atol=1e-5
                )
            assert not out[b, q_lens[b] :].any()
        done = seq_lens

    for _ in range(DECODE_STEPS):
        write([(b, done[b]) for b in range(2)])
        q = np.stack([q_all[b][done[b]] for b in range(2)])
        lengths = jnp.asarray([n + 1 for n in done], jnp.int32)
        out = np.asarray(paged_attention(jnp.asarray(q), k_pages, v_pages, lengths, tables_j, **knobs))
        for b in range(2):
            np.testing.assert_allclose(
                out[b], _dense_causal(q_all[b], k_all[b], v_all[b], done[b]), atol=1e-5
            )
        done = [n + 1 for n in done]
