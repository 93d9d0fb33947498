"""The shared online-softmax update, block by block, against a one-shot softmax in numpy."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from rlax_kernels.paged_attention.online_softmax import (
    online_softmax_add_key,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_update,
)


def _dense_attention(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """softmax(scores) @ values in float64, in one pass; rows with every key masked give 0."""
    scores = scores.astype(np.float64)
    out = np.zeros((scores.shape[0], values.shape[1]))
    for r, row in enumerate(scores):
        seen = np.isfinite(row)
        if not seen.any():
            continue
        weights = np.exp(row[seen] - row[seen].max())
        out[r] = (weights / weights.sum()) @ values[seen].astype(np.float64)
    return out


def _in_blocks(scores, values, cuts, *, keepdims, precision=None):  # type: ignore[no-untyped-def]
    """Run the online update over the keys split at `cuts`, zeroing masked values as the kernels do."""
    state = online_softmax_init(scores.shape[0], values.shape[1], keepdims=keepdims)
    bounds = [0, *cuts, scores.shape[1]]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s = jnp.asarray(scores[:, lo:hi])
        v = jnp.asarray(values[lo:hi])
        masked = ~np.isfinite(scores[:, lo:hi]).any(axis=0)
        v = jnp.where(jnp.asarray(masked)[:, None], jnp.zeros_like(v), v)
        state = online_softmax_update(state, s, v, precision=precision)
    return state


@pytest.mark.parametrize("keepdims", [False, True])
def test_hand_worked_two_blocks(keepdims: bool) -> None:
    # Scores 0, ln 2 | ln 5: weights 1/8, 2/8, 5/8 over values 8, 0, 16 -> 1 + 0 + 10 = 11.
    scores = np.array([[0.0, math.log(2), math.log(5)]], np.float32)
    values = np.array([[8.0], [0.0], [16.0]], np.float32)
    state = _in_blocks(scores, values, [2], keepdims=keepdims)
    m, l_sum, acc = state
    assert m.shape == l_sum.shape == ((1, 1) if keepdims else (1,))
    np.testing.assert_allclose(np.asarray(m).ravel(), [math.log(5)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l_sum).ravel(), [8 / 5], rtol=1e-6)  # (1 + 2 + 5) / 5
    np.testing.assert_allclose(np.asarray(online_softmax_finish(state)), [[11.0]], rtol=1e-6)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("cuts", [[16], [5, 11], [1, 2, 3, 30], [8, 16, 24]])
def test_blocks_match_one_shot_softmax(keepdims: bool, cuts: list[int]) -> None:
    rng = np.random.default_rng(0)
    rows, keys, head_dim = 6, 32, 8
    scores = (rng.normal(size=(rows, keys)) * 4).astype(np.float32)
    values = rng.normal(size=(keys, head_dim)).astype(np.float32)
    scores[1, :20] = -np.inf  # row 1 sees nothing in the first blocks
    scores[2, 3:] = -np.inf  # row 2 sees only the first three keys
    scores[3] = -np.inf  # row 3 sees nothing at all: its output is 0
    scores[:, 30] = -np.inf  # key 30 is masked for every row, and its value is garbage
    values[30] = np.nan
    state = _in_blocks(scores, values, cuts, keepdims=keepdims, precision=lax.Precision.HIGHEST)
    out = np.asarray(online_softmax_finish(state))
    assert out.dtype == np.float32 and out.shape == (rows, head_dim)
    np.testing.assert_allclose(out, _dense_attention(scores, values), rtol=1e-5, atol=1e-6)


def test_bfloat16_values_accumulate_in_float32() -> None:
    # Equal scores make every probability exactly 1 (exact in bfloat16) and the values are
    # exact in bfloat16, so a float32 sum of each block is exact; a bfloat16 one (spacing 2
    # near 256) would be off by ~1e-3 relative.
    values = 1.0 + np.arange(256, dtype=np.float32) % 8 / 128  # 1, 1 + 1/128, ..., 1 + 7/128
    values = np.stack([values, values[::-1] * 2], axis=1)
    scores = np.zeros((2, 512), np.float32)
    state = _in_blocks(
        scores, jnp.asarray(np.concatenate([values, values]), jnp.bfloat16), [256], keepdims=True
    )
    assert all(x.dtype == jnp.float32 for x in state)
    np.testing.assert_allclose(np.asarray(online_softmax_finish(state)), [values.mean(axis=0)] * 2, rtol=1e-6)


@pytest.mark.parametrize("keepdims", [False, True])
def test_add_key_equals_one_more_key(keepdims: bool) -> None:
    rng = np.random.default_rng(2)
    scores = rng.normal(size=(3, 17)).astype(np.float32)
    values = rng.normal(size=(17, 4)).astype(np.float32)
    scores[0, :16] = -np.inf  # row 0 sees only the added key
    state = _in_blocks(scores[:, :16], values[:16], [8], keepdims=keepdims, precision=lax.Precision.HIGHEST)
    state = online_softmax_add_key(state, jnp.asarray(scores[:, 16:]), jnp.asarray(values[16:]))
    np.testing.assert_allclose(
        np.asarray(online_softmax_finish(state)), _dense_attention(scores, values), rtol=1e-5, atol=1e-6
    )
