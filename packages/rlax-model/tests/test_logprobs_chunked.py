"""Chunked log-probs of sampled tokens: same values and gradients as a dense float64
log_softmax, with less compiled scratch memory than the dense [B, T, V] float32 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_model.logprobs import head_logprobs


def reference(hidden, targets, w, coef, temperature):
    """float64 numpy: logprobs [B, T], entropy [B, T], and the gradients of sum(coef * logprobs)
    w.r.t. hidden [B, T, H] and w [H, V] (d/dz log_softmax(z)[y] = onehot(y) - softmax(z))."""
    h, w = np.asarray(hidden, np.float64), np.asarray(w, np.float64)
    z = np.einsum("bth,hv->btv", h, w) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    lp = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    ent = -(p * logp).sum(-1)
    onehot = np.eye(w.shape[1])[targets]
    dz = coef[..., None] * (onehot - p) / temperature
    return lp, ent, np.einsum("btv,hv->bth", dz, w), np.einsum("bth,btv->hv", h, dz)


@pytest.mark.parametrize("chunk_size", [None, 5, 16, 64])
def test_chunked_matches_float64_reference(chunk_size):
    rng = np.random.default_rng(0)
    b, t, hdim, v, temp = 2, 37, 16, 300, 0.7
    hidden = rng.normal(size=(b, t, hdim)).astype(np.float32)
    w = (0.5 * rng.normal(size=(hdim, v))).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    coef = rng.normal(size=(b, t)).astype(np.float32)
    lp_ref, ent_ref, dh_ref, dw_ref = reference(hidden, targets, w, coef, temp)

    def loss(hd, ww):
        lp, _ = head_logprobs(hd, jnp.asarray(targets), ww, temperature=temp, chunk_size=chunk_size)
        return jnp.sum(coef * lp)

    lp, ent = head_logprobs(
        jnp.asarray(hidden), jnp.asarray(targets), jnp.asarray(w), temperature=temp, chunk_size=chunk_size
    )
    dh, dw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(w))
    np.testing.assert_allclose(lp, lp_ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, ent_ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(dh, dh_ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(dw, dw_ref, atol=2e-5, rtol=1e-4)


def test_chunked_backward_needs_less_scratch_than_dense():
    b, t, hdim, v = 4, 256, 32, 4096  # dense f32 logits: 16 MiB per copy
    hidden = jax.ShapeDtypeStruct((b, t, hdim), jnp.float32)
    w = jax.ShapeDtypeStruct((hdim, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(chunk_size):
        def loss(hd, ww, tg):
            lp, ent = head_logprobs(hd, tg, ww, chunk_size=chunk_size)
            return jnp.sum(lp) + 0.01 * jnp.sum(ent)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, w, targets).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    dense, chunked = temp_bytes(None), temp_bytes(32)  # 32 of the b * t = 1024 tokens a chunk
    logits_bytes = b * t * v * 4
    assert dense >= logits_bytes  # the dense backward holds at least one full logits tensor
    assert chunked < logits_bytes / 4


@pytest.mark.parametrize("chunk_size", [None, 4, 16])
def test_scored_positions_match_the_reference_and_the_rest_are_zero(chunk_size):
    """A loss mask: the scored positions' values and gradients are the float64 reference's
    (of sum(coef * lp) over scored positions only); unscored positions come back 0."""
    rng = np.random.default_rng(1)
    b, t, hdim, v, temp = 3, 29, 16, 200, 0.9
    hidden = rng.normal(size=(b, t, hdim)).astype(np.float32)
    w = (0.5 * rng.normal(size=(hdim, v))).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    scored = np.zeros((b, t), bool)
    scored[0, 20:] = True  # a reply at the end of a row
    scored[2, 5:9] = True  # a short one in the middle; row 1 scores nothing
    coef = rng.normal(size=(b, t)).astype(np.float32) * scored
    lp_ref, ent_ref, dh_ref, dw_ref = reference(hidden, targets, w, coef, temp)

    def run(hd, ww):
        return head_logprobs(
            hd, jnp.asarray(targets), ww, temperature=temp, chunk_size=chunk_size, scored=jnp.asarray(scored)
        )

    lp, ent = run(jnp.asarray(hidden), jnp.asarray(w))
    dh, dw = jax.grad(lambda hd, ww: jnp.sum(coef * run(hd, ww)[0]), argnums=(0, 1))(
        jnp.asarray(hidden), jnp.asarray(w)
    )
    np.testing.assert_allclose(np.where(scored, lp, 0), np.where(scored, lp_ref, 0), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.where(scored, ent, 0), np.where(scored, ent_ref, 0), atol=2e-5, rtol=1e-5)
    assert not np.any(np.asarray(lp)[~scored]) and not np.any(np.asarray(ent)[~scored])
    np.testing.assert_allclose(dh, dh_ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(dw, dw_ref, atol=2e-5, rtol=1e-4)
