"""Core decoder API on tiny random models: shapes, padding, the attention seam, remat, logprobs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_model import (
    DenseContext,
    Llama3RopeScaling,
    ModelConfig,
    dense_attention_reference,
    forward,
    init_params,
    logprobs,
    param_shapes,
    positions_from_valid,
    token_logprobs_from_logits,
)

CONFIGS = {
    "llama": ModelConfig.tiny(),
    "qwen2": ModelConfig.tiny(attention_bias=True, tie_word_embeddings=True, architecture="qwen2"),
    "qwen3": ModelConfig.tiny(qk_norm=True, architecture="qwen3", num_kv_heads=1),
    "llama3_rope": ModelConfig.tiny(
        rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=64)
    ),
}

jit_forward = jax.jit(forward, static_argnames=("config", "attention", "remat"))
jit_logprobs = jax.jit(
    logprobs, static_argnames=("config", "attention", "return_entropy", "remat", "chunk_size", "temperature")
)


def _random_params(config: ModelConfig, seed: int = 0):
    # Non-trivial norms and biases so that every parameter influences the output.
    params = init_params(config, jax.random.key(seed), std=0.2)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _arange_positions(tokens):
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shapes_dtypes_and_stacked_layers(name):
    config = CONFIGS[name]
    params = init_params(config, jax.random.key(0))
    got = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
    assert got == param_shapes(config)
    assert all(x.shape[0] == config.num_layers for x in jax.tree_util.tree_leaves(params["layers"]))
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == config.num_params()
    tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    logits, cache = jit_forward(params, tokens, _arange_positions(tokens), config=config)
    assert logits.shape == (2, 5, config.vocab_size) and logits.dtype == jnp.float32
    assert cache is None
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_left_and_right_padding_match_unpadded(name):
    config = CONFIGS[name]
    params = _random_params(config)
    seq = np.array([5, 17, 9, 33, 2, 41], np.int32)
    ref, _ = jit_forward(
        params, jnp.asarray(seq[None]), _arange_positions(jnp.asarray(seq[None])), config=config
    )
    pad = 3
    left = np.concatenate([np.zeros(pad, np.int32), seq])
    right = np.concatenate([seq, np.zeros(pad, np.int32)])
    tokens = jnp.asarray(np.stack([left, right]))
    valid = jnp.asarray(np.stack([np.arange(9) >= pad, np.arange(9) < 6]))
    logits, _ = jit_forward(
        params, tokens, positions_from_valid(valid), config=config, attention_context=DenseContext(valid)
    )
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(logits[0, pad:], ref[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1, :6], ref[0], atol=1e-5, rtol=0)


def test_causality():
    config = CONFIGS["llama"]
    params = _random_params(config)
    a = jnp.array([[3, 4, 5, 6, 7]], jnp.int32)
    b = a.at[0, 3:].set(jnp.array([90, 91]))
    la, _ = jit_forward(params, a, _arange_positions(a), config=config)
    lb, _ = jit_forward(params, b, _arange_positions(b), config=config)
    np.testing.assert_array_equal(la[0, :3], lb[0, :3])
    assert not np.allclose(la[0, 3:], lb[0, 3:])


def test_dense_reference_against_numpy():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 3, 4, 8)).astype(np.float32)
    k = rng.normal(size=(1, 3, 2, 8)).astype(np.float32)
    v = rng.normal(size=(1, 3, 2, 8)).astype(np.float32)
    mask = np.tril(np.ones((3, 3), bool))[None, None]
    out = np.asarray(
        dense_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    )
    for h in range(4):
        kv = h // 2
        s = q[0, :, h] @ k[0, :, kv].T / np.sqrt(8)
        s = np.where(mask[0, 0], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[0, :, h], p @ v[0, :, kv], atol=1e-5)


# A cache-owning attention function, written against the documented seam only: the cache per
# layer is {"k", "v": [batch, max_len, nkv, d]}; the context says where this call writes.
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _CacheContext:
    start: jax.Array  # [] int32: index of the first new token in the cache


def _cached_attention(q, k, v, layer_cache, ctx):
    kc = jax.lax.dynamic_update_slice_in_dim(layer_cache["k"], k, ctx.start, axis=1)
    vc = jax.lax.dynamic_update_slice_in_dim(layer_cache["v"], v, ctx.start, axis=1)
    q_idx = ctx.start + jnp.arange(q.shape[1])
    k_idx = jnp.arange(kc.shape[1])
    mask = (k_idx[None, :] <= q_idx[:, None])[None, None]
    return dense_attention_reference(q, kc, vc, mask), {"k": kc, "v": vc}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_pluggable_attention_with_kv_cache_matches_full_forward(name):
    config = CONFIGS[name]
    params = _random_params(config)
    tokens = jnp.array([[5, 17, 9, 33, 2, 41, 7, 8]], jnp.int32)
    full, _ = jit_forward(params, tokens, _arange_positions(tokens), config=config)
    shape = (config.num_layers, 1, 16, config.num_kv_heads, config.head_dim)
    cache = {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}
    step = jax.jit(functools.partial(forward, config=config, attention=_cached_attention))
    prompt = 5
    logits, cache = step(
        params,
        tokens[:, :prompt],
        _arange_positions(tokens[:, :prompt]),
        attention_context=_CacheContext(jnp.int32(0)),
        kv_cache=cache,
    )
    np.testing.assert_allclose(logits, full[:, :prompt], atol=1e-5)
    assert cache["k"].shape == shape
    for t in range(prompt, tokens.shape[1]):
        logits, cache = step(
            params,
            tokens[:, t : t + 1],
            jnp.full((1, 1), t, jnp.int32),
            attention_context=_CacheContext(jnp.int32(t)),
            kv_cache=cache,
        )
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5)


def test_logprobs_and_entropy_match_log_softmax():
    config = CONFIGS["qwen2"]
    params = _random_params(config)
    tokens = jnp.array([[0, 0, 5, 17, 9, 33], [5, 17, 9, 33, 2, 41]], jnp.int32)
    valid = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    ctx = DenseContext(valid)
    logits, _ = jit_forward(params, tokens, positions_from_valid(valid), config=config, attention_context=ctx)
    ref = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    ref_lp = np.take_along_axis(np.asarray(ref), np.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]
    ref_ent = -(np.exp(ref) * ref).sum(-1)
    lp, ent = jit_logprobs(params, tokens, config=config, attention_context=ctx, return_entropy=True)
    assert lp.shape == (2, 5) and lp.dtype == jnp.float32
    np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
    lp_c, ent_c = jit_logprobs(
        params, tokens, config=config, attention_context=ctx, return_entropy=True, chunk_size=2
    )
    np.testing.assert_allclose(lp_c, lp, atol=1e-6)
    np.testing.assert_allclose(ent_c, ent, atol=1e-6)
    hot = jit_logprobs(params, tokens, config=config, attention_context=ctx, temperature=0.5)
    ref_hot, _ = token_logprobs_from_logits(logits[:, :-1], tokens[:, 1:], temperature=0.5)
    np.testing.assert_allclose(hot, ref_hot, atol=1e-5)


def test_remat_gives_same_gradients():
    config = CONFIGS["llama"]
    params = _random_params(config)
    tokens = jnp.array([[5, 17, 9, 33, 2, 41]], jnp.int32)

    def loss(p, remat):
        return -logprobs(p, tokens, config=config, remat=remat, chunk_size=4).sum()

    g_ref = jax.jit(jax.grad(functools.partial(loss, remat=None)))(params)
    for remat in ("full", "nothing_saveable", "dots_saveable"):
        g = jax.jit(jax.grad(functools.partial(loss, remat=remat)))(params)
        for a, b in zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=remat)


def test_bfloat16_policy_keeps_logits_float32_and_close():
    config = CONFIGS["llama"]
    params = _random_params(config)
    bf = config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params_bf = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    tokens = jnp.array([[5, 17, 9, 33, 2, 41]], jnp.int32)
    ref, _ = jit_forward(params, tokens, _arange_positions(tokens), config=config)
    got, _ = jit_forward(params_bf, tokens, _arange_positions(tokens), config=bf)
    assert got.dtype == jnp.float32
    assert init_params(bf, jax.random.key(0))["embed"].dtype == jnp.bfloat16
    scale = float(jnp.abs(ref).max())
    assert float(jnp.abs(got - ref).max()) < 0.1 * scale
    lp = jit_logprobs(params_bf, tokens, config=bf)
    assert lp.dtype == jnp.float32


def test_bad_inputs_name_the_problem():
    config = CONFIGS["llama"]
    params = init_params(config, jax.random.key(0))
    tokens = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="positions shape"):
        forward(params, tokens, jnp.zeros((2, 3), jnp.int32), config=config)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\]"):
        forward(params, jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32), config=config)
    with pytest.raises(ValueError, match="tokens must be an integer"):
        forward(params, tokens.astype(jnp.float32), tokens, config=config)
    with pytest.raises(ValueError, match="DenseContext.valid has shape"):
        forward(params, tokens, tokens, config=config, attention_context=DenseContext(jnp.ones((2, 5), bool)))
    with pytest.raises(ValueError, match="remat='everything'"):
        forward(params, tokens, tokens, config=config, remat="everything")
    with pytest.raises(ValueError, match="seq >= 2"):
        logprobs(params, tokens[:, :1], config=config)
