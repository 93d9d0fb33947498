"""The pure-jnp references against numbers worked out by hand (and a plain numpy loop)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_kernels import (
    paged_attention,
    paged_attention_reference,
    paged_prefill_attention_reference,
    slots_from_positions,
    write_kv,
)
from rlax_kernels.paged_attention.testing import make_paged_case

NAN = float("nan")


def _hand_cache() -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One KV head, head_dim 2, page_size 2; a 3-token sequence stored in pages 3 then 1.

    keys   k0=[0, 5]  k1=[ln 2, 7]  k2=[ln 5, -1]
    values v0=[8, 0]  v1=[0, 8]     v2=[8, 8]
    With q=[1, 0] and scale 1 the scores are 0, ln 2, ln 5, so the weights are 1/8, 2/8, 5/8.
    Every other slot is NaN.
    """
    k = np.full((1, 4, 2, 2), NAN, np.float32)
    v = np.full((1, 4, 2, 2), NAN, np.float32)
    k[0, 3, 0], k[0, 3, 1], k[0, 1, 0] = [0.0, 5.0], [math.log(2), 7.0], [math.log(5), -1.0]
    v[0, 3, 0], v[0, 3, 1], v[0, 1, 0] = [8.0, 0.0], [0.0, 8.0], [8.0, 8.0]
    # The third table entry is unused: it points far outside the cache.
    tables = jnp.asarray([[3, 1, 999]], jnp.int32)
    return jnp.asarray(k), jnp.asarray(v), tables


def test_decode_reference_hand_worked() -> None:
    k, v, tables = _hand_cache()
    # Two query heads share the KV head: q=[1,0] gives weights 1/8, 2/8, 5/8 -> [6, 7];
    # q=[0,0] gives uniform weights -> [16/3, 16/3].
    q = jnp.asarray([[[1.0, 0.0], [0.0, 0.0]]], jnp.float32)
    out = paged_attention_reference(q, k, v, jnp.asarray([3], jnp.int32), tables, scale=1.0)
    np.testing.assert_allclose(np.asarray(out), [[[6.0, 7.0], [16 / 3, 16 / 3]]], rtol=1e-6)


def test_decode_reference_length_one_and_page_boundary() -> None:
    k, v, tables = _hand_cache()
    q = jnp.asarray([[[1.0, 0.0]], [[1.0, 0.0]]], jnp.float32)
    tables2 = jnp.concatenate([tables, tables])
    out = paged_attention_reference(q, k, v, jnp.asarray([1, 2], jnp.int32), tables2, scale=1.0)
    # Length 1: only v0. Length 2 (exactly one page): weights 1/3, 2/3 -> [8/3, 16/3].
    np.testing.assert_allclose(np.asarray(out), [[[8.0, 0.0]], [[8 / 3, 16 / 3]]], rtol=1e-6)


def test_decode_reference_default_scale_is_inverse_sqrt_head_dim() -> None:
    k, v, tables = _hand_cache()
    q = jnp.asarray([[[math.sqrt(2.0), 0.0]]], jnp.float32)  # sqrt(2) / sqrt(head_dim=2) = 1
    out = paged_attention_reference(q, k, v, jnp.asarray([3], jnp.int32), tables)
    np.testing.assert_allclose(np.asarray(out), [[[6.0, 7.0]]], rtol=1e-6)


def test_prefill_reference_hand_worked_causal() -> None:
    k, v, tables = _hand_cache()
    q = jnp.asarray([[[[1.0, 0.0]]] * 3 + [[[NAN, NAN]]]], jnp.float32)  # [1, chunk=4, 1, 2]
    out = paged_prefill_attention_reference(
        q, k, v, jnp.asarray([3], jnp.int32), jnp.asarray([3], jnp.int32), tables, scale=1.0
    )
    # Row 0 sees k0; row 1 sees k0,k1 (1/3, 2/3); row 2 sees all three; row 3 is padding.
    expected = [[[[8.0, 0.0]], [[8 / 3, 16 / 3]], [[6.0, 7.0]], [[0.0, 0.0]]]]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)


def test_prefill_reference_chunk_after_cached_prefix() -> None:
    k, v, tables = _hand_cache()
    # Tokens 0-1 are cached; the chunk holds token 2 only, at position 2: the decode answer.
    q = jnp.asarray([[[[1.0, 0.0]], [[NAN, NAN]]]], jnp.float32)
    out = paged_prefill_attention_reference(
        q, k, v, jnp.asarray([3], jnp.int32), jnp.asarray([1], jnp.int32), tables, scale=1.0
    )
    np.testing.assert_allclose(np.asarray(out), [[[[6.0, 7.0]], [[0.0, 0.0]]]], rtol=1e-6)


def _numpy_attention(q, keys, values, scale):
    scores = keys @ q * scale
    w = np.exp(scores - scores.max())
    return (w / w.sum()) @ values


def test_decode_reference_matches_numpy_loop_with_gqa() -> None:
    case = make_paged_case(
        7, seq_lens=[1, 16, 37], num_heads=8, num_kv_heads=2, head_dim=16, page_size=8, spare_pages=2
    )
    out = np.asarray(
        paged_attention_reference(case.q, case.k_pages, case.v_pages, case.seq_lens, case.block_tables)
    )
    k, v, q, tables = (np.asarray(a) for a in (case.k_pages, case.v_pages, case.q, case.block_tables))
    for b, length in enumerate(np.asarray(case.seq_lens)):
        pages = tables[b, : -(-length // 8)]
        for n in range(8):
            h = n // 4
            keys = k[h, pages].reshape(-1, 16)[:length]
            values = v[h, pages].reshape(-1, 16)[:length]
            np.testing.assert_allclose(
                out[b, n], _numpy_attention(q[b, n], keys, values, 0.25), rtol=1e-5, atol=1e-6
            )


def test_auto_backend_on_cpu_is_the_native_kernel() -> None:
    case = make_paged_case(3, seq_lens=[5, 9], num_heads=4, num_kv_heads=1, head_dim=8, page_size=4)
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.block_tables)
    auto = np.asarray(paged_attention(*args))
    np.testing.assert_array_equal(auto, np.asarray(paged_attention(*args, backend="cpu")))
    np.testing.assert_allclose(auto, np.asarray(paged_attention_reference(*args)), rtol=1e-6, atol=1e-6)


def test_write_kv_hand_worked() -> None:
    k = jnp.zeros((2, 3, 2, 1), jnp.float32)  # 2 KV heads, 3 pages of 2 slots, head_dim 1
    v = jnp.zeros_like(k)
    new_k = jnp.asarray([[[1.0], [10.0]], [[2.0], [20.0]], [[3.0], [30.0]]])  # [3 tokens, 2 heads, 1]
    slots = jnp.asarray([5, -1, 0], jnp.int32)  # page 2 slot 1; padding; page 0 slot 0
    k2, v2 = write_kv(k, v, new_k, -new_k, slots)
    expected = np.zeros((2, 3, 2, 1), np.float32)
    expected[0, 2, 1, 0], expected[1, 2, 1, 0] = 1.0, 10.0
    expected[0, 0, 0, 0], expected[1, 0, 0, 0] = 3.0, 30.0
    np.testing.assert_array_equal(np.asarray(k2), expected)
    np.testing.assert_array_equal(np.asarray(v2), -expected)


def test_write_kv_casts_to_the_cache_dtype() -> None:
    k = jnp.zeros((1, 1, 4, 2), jnp.bfloat16)
    k2, _ = write_kv(k, k, jnp.full((1, 1, 2), 1.5, jnp.float32), jnp.ones((1, 1, 2)), jnp.asarray([2]))
    assert k2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(k2[0, 0, 2], np.float32), [1.5, 1.5])


def test_slots_from_positions_hand_worked() -> None:
    tables = jnp.asarray([[4, 2, 0], [1, 3, 0]], jnp.int32)
    rows = tables[jnp.asarray([0, 0, 1, 1])]
    slots = slots_from_positions(rows, jnp.asarray([0, 5, 3, -1]), page_size=4)
    # pos 0 -> page 4 slot 0 = 16; pos 5 -> page 2 slot 1 = 9; pos 3 -> page 1 slot 3 = 7.
    np.testing.assert_array_equal(np.asarray(slots), [16, 9, 7, -1])


@pytest.mark.parametrize("chunks", [[7], [3, 4], [1, 1, 5]])
def test_chunked_prefill_equals_whole_prompt(chunks: list[int]) -> None:
    """Feeding a prompt in chunks (cache filled progressively) equals one whole-prompt pass."""
    case = make_paged_case(
        11, seq_lens=[7], num_heads=4, num_kv_heads=2, head_dim=8, page_size=4, chunk=7, poison=False
    )
    whole = paged_prefill_attention_reference(
        case.q, case.k_pages, case.v_pages, case.seq_lens, case.q_lens, case.block_tables
    )
    start, parts = 0, []
    for size in chunks:
        q = case.q[:, start : start + size]
        seq = jnp.asarray([start + size], jnp.int32)
        parts.append(
            paged_prefill_attention_reference(
                q, case.k_pages, case.v_pages, seq, jnp.asarray([size], jnp.int32), case.block_tables
            )
        )
        start += size
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(parts, axis=1)), np.asarray(whole), rtol=1e-5, atol=1e-6
    )
