"""Greedy decoding for tests, through the documented attention seam with a dense KV cache."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_model import ModelConfig, Params, dense_attention_reference, forward


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheContext:
    start: jax.Array  # [] int32: cache index of the first token of this call
    key_valid: jax.Array  # [batch, max_len] bool: which cache slots hold real tokens


def cached_attention(q, k, v, layer_cache, ctx):
    """Dense attention over a per-layer cache {"k", "v": [batch, max_len, nkv, d]}."""
    kc = jax.lax.dynamic_update_slice_in_dim(
        layer_cache["k"], k.astype(layer_cache["k"].dtype), ctx.start, axis=1
    )
    vc = jax.lax.dynamic_update_slice_in_dim(
        layer_cache["v"], v.astype(layer_cache["v"].dtype), ctx.start, axis=1
    )
    q_idx = ctx.start + jnp.arange(q.shape[1])
    k_idx = jnp.arange(kc.shape[1])
    mask = (k_idx[None, :] <= q_idx[:, None])[None, None] & ctx.key_valid[:, None, None, :]
    return dense_attention_reference(q, kc, vc, mask), {"k": kc, "v": vc}


@functools.partial(jax.jit, static_argnames=("config",))
def _step(params, tokens, positions, start, key_valid, cache, *, config):
    logits, cache = forward(
        params,
        tokens,
        positions,
        config=config,
        attention=cached_attention,
        attention_context=CacheContext(start, key_valid),
        kv_cache=cache,
    )
    return logits[:, -1], cache


def greedy_generate(
    params: Params, config: ModelConfig, prompts: list[list[int]], new_tokens: int
) -> np.ndarray:
    """Greedy continuation of left-padded prompts; returns [batch, new_tokens] int32."""
    b, plen = len(prompts), max(map(len, prompts))
    max_len = plen + new_tokens
    tokens = np.zeros((b, plen), np.int32)
    key_valid = np.zeros((b, max_len), bool)
    for i, p in enumerate(prompts):
        tokens[i, plen - len(p) :] = p
        key_valid[i, plen - len(p) : plen] = True
    positions = np.maximum(np.cumsum(key_valid[:, :plen], axis=1) - 1, 0).astype(np.int32)
    shape = (config.num_layers, b, max_len, config.num_kv_heads, config.head_dim)
    cache = {"k": jnp.zeros(shape, config.compute_jnp_dtype), "v": jnp.zeros(shape, config.compute_jnp_dtype)}
    lengths = np.array([len(p) for p in prompts], np.int32)
    logits, cache = _step(
        params,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        jnp.int32(0),
        jnp.asarray(key_valid),
        cache,
        config=config,
    )
    out = []
    for t in range(new_tokens):
        nxt = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
        out.append(nxt)
        if t == new_tokens - 1:
            break
        key_valid[:, plen + t] = True
        logits, cache = _step(
            params,
            jnp.asarray(nxt[:, None]),
            jnp.asarray((lengths + t)[:, None]),
            jnp.int32(plen + t),
            jnp.asarray(key_valid),
            cache,
            config=config,
        )
    return np.stack(out, axis=1)
