"""The Llama-family decoder as pure functions over a nested-dict parameter pytree.

Parameter layout (`Params`), with L = num_layers, H = hidden_size, I = intermediate_size,
Q = num_heads * head_dim, K = num_kv_heads * head_dim, V = vocab_size; weight matrices are
stored [in, out] so that `x @ w` applies them:

    embed            [V, H]
    layers/attn_norm [L, H]          layers/mlp_norm  [L, H]
    layers/q_proj    [L, H, Q]       layers/q_bias    [L, Q]   (attention_bias only)
    layers/k_proj    [L, H, K]       layers/k_bias    [L, K]   (attention_bias only)
    layers/v_proj    [L, H, K]       layers/v_bias    [L, K]   (attention_bias only)
    layers/o_proj    [L, Q, H]
    layers/q_norm    [L, head_dim]   layers/k_norm    [L, head_dim]  (qk_norm only)
    layers/gate_proj [L, H, I]       layers/up_proj   [L, H, I]      layers/down_proj [L, I, H]
    final_norm       [H]
    lm_head          [H, V]          (absent when tie_word_embeddings: embed.T is used)
    layers/lora/<name>/{a [L, in, r], b [L, r, out]}  (optional adapters: `rlax_model.lora`)

Per-layer weights are stacked on a leading [L] axis so `forward` is one `jax.lax.scan`
(compile time independent of depth).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from rlax_model.attention import AttentionFn, dense_causal_attention
from rlax_model.config import ModelConfig
from rlax_model.layers import apply_rope, project, rms_norm, rope_tables, row_matmul, swiglu_mlp

Params = dict[str, Any]
Remat = Literal["full", "nothing_saveable", "dots_saveable"] | None

_REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    # Recompute everything inside a layer in the backward pass; only layer inputs are kept.
    "full": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    # Keep matmul outputs without batch dims, recompute the cheap elementwise ops.
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The expected shape of every parameter, in the `Params` nesting (tuples as leaves)."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_layers
    d = config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (n, h),
        "q_proj": (n, h, q),
        "k_proj": (n, h, kv),
        "v_proj": (n, h, kv),
        "o_proj": (n, q, h),
        "mlp_norm": (n, h),
        "gate_proj": (n, h, i),
        "up_proj": (n, h, i),
        "down_proj": (n, i, h),
    }
    if config.attention_bias:
        layers.update(q_bias=(n, q), k_bias=(n, kv), v_bias=(n, kv))
    if config.qk_norm:
        layers.update(q_norm=(n, d), k_norm=(n, d))
    shapes: dict[str, Any] = {"embed": (v, h), "layers": layers, "final_norm": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (h, v)
    return shapes


def init_params(config: ModelConfig, key: jax.Array, *, std: float = 0.02) -> Params:
    """Random parameters: normal(0, std) matrices, zero biases, unit norm scales; in param_dtype."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    dtype = config.param_jnp_dtype
    leaves = []
    for (path, shape), k in zip(flat, keys, strict=True):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, dtype))
        elif name.endswith("bias"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    params: Params = jax.tree_util.tree_unflatten(treedef, leaves)
    return params


def _check_inputs(tokens: jax.Array, positions: jax.Array) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ValueError(f"positions shape {positions.shape} differs from tokens shape {tokens.shape}")
    for name, arr in (("tokens", tokens), ("positions", positions)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")


def _decoder_layer(
    x: jax.Array,
    layer: Params,
    cos: jax.Array,
    sin: jax.Array,
    layer_cache: Any,
    attention_context: Any,
    *,
    config: ModelConfig,
    attention: AttentionFn,
) -> tuple[jax.Array, Any]:
    b, s, _ = x.shape
    nh, nkv, d, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    cdt, f32 = config.compute_jnp_dtype, jnp.float32
    # x (the residual stream) is float32. Values are rounded to the compute dtype only where
    # they enter a matmul or the attention (whose K/V the engine caches in that dtype):
    # projections accumulate and leave in float32, RoPE, norms and residual adds run in float32.
    h = rms_norm(x, layer["attn_norm"], eps, dtype=cdt)
    q = project(h, layer, "q_proj", layer.get("q_bias"), dtype=f32).reshape(b, s, nh, d)
    k = project(h, layer, "k_proj", layer.get("k_bias"), dtype=f32).reshape(b, s, nkv, d)
    v = project(h, layer, "v_proj", layer.get("v_bias"), dtype=cdt).reshape(b, s, nkv, d)
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], eps)
        k = rms_norm(k, layer["k_norm"], eps)
    q = apply_rope(q, cos, sin).astype(cdt)
    k = apply_rope(k, cos, sin).astype(cdt)
    attn, new_cache = attention(q, k, v, layer_cache, attention_context)
    if attn.shape != (b, s, nh, d):
        raise ValueError(f"attention returned shape {attn.shape}, expected {(b, s, nh, d)}")
    x = x + project(attn.astype(cdt).reshape(b, s, nh * d), layer, "o_proj", dtype=f32)
    x = x + swiglu_mlp(rms_norm(x, layer["mlp_norm"], eps, dtype=cdt), layer)
    return x, new_cache


def hidden_states(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    attention: AttentionFn | None = None,
    attention_context: Any = None,
    kv_cache: Any = None,
    remat: Remat = None,
) -> tuple[jax.Array, Any]:
    """The decoder up to (and including) the final norm.

    tokens, positions: [batch, seq] int32. Returns (hidden [batch, seq, hidden_size] in
    compute dtype, new_kv_cache with the structure of `kv_cache`).
    """
    _check_inputs(tokens, positions)
    if attention is None:
        attention = functools.partial(dense_causal_attention, sliding_window=config.sliding_window)
    # The residual stream is float32 whatever the compute dtype (see `_decoder_layer`).
    x = jnp.take(params["embed"], tokens, axis=0).astype(config.compute_jnp_dtype).astype(jnp.float32)
    cos, sin = rope_tables(positions, config)

    def body(carry: jax.Array, xs: tuple[Params, Any]) -> tuple[jax.Array, Any]:
        layer, layer_cache = xs
        return _decoder_layer(
            carry, layer, cos, sin, layer_cache, attention_context, config=config, attention=attention
        )

    if remat is not None:
        if remat not in _REMAT_POLICIES:
            raise ValueError(f"remat={remat!r}: must be None or one of {sorted(_REMAT_POLICIES)}")
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[remat], prevent_cse=False)
    x, new_cache = jax.lax.scan(body, x, (params["layers"], kv_cache))
    return rms_norm(x, params["final_norm"], config.rms_norm_eps, dtype=config.compute_jnp_dtype), new_cache


def lm_head_weight(params: Params, config: ModelConfig) -> jax.Array:
    """The output projection [hidden_size, vocab_size] (embed.T when embeddings are tied)."""
    weight: jax.Array = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return weight


def project_logits(hidden: jax.Array, params: Params, config: ModelConfig) -> jax.Array:
    """hidden [..., hidden_size] (compute dtype) -> logits [..., vocab_size] float32."""
    w = lm_head_weight(params, config).astype(hidden.dtype)
    return row_matmul(hidden, w)


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    attention: AttentionFn | None = None,
    attention_context: Any = None,
    kv_cache: Any = None,
    remat: Remat = None,
) -> tuple[jax.Array, Any]:
    """Run the decoder.

    tokens, positions: [batch, seq] int32 (positions are RoPE positions, so a left-padded
    row typically has positions from `positions_from_valid`).
    attention: an `AttentionFn` (default `dense_causal_attention`, whose context is a
    `DenseContext` or None). kv_cache: None or a pytree whose leaves have a leading
    [num_layers] axis; each layer's slice is handed to `attention`.
    remat: None, "full" / "nothing_saveable" (recompute each layer in the backward pass),
    or "dots_saveable".

    Returns (logits [batch, seq, vocab_size] float32, new_kv_cache).
    """
    hidden, new_cache = hidden_states(
        params,
        tokens,
        positions,
        config=config,
        attention=attention,
        attention_context=attention_context,
        kv_cache=kv_cache,
        remat=remat,
    )
    return project_logits(hidden, params, config), new_cache
