"""Per-token log-probabilities (and entropies) of given sequences, shared by trainer and engine."""

from __future__ import annotations

from typing import Any, Literal, overload

import jax
import jax.numpy as jnp

from rlax_model.attention import AttentionFn, DenseContext, positions_from_valid
from rlax_model.config import ModelConfig
from rlax_model.transformer import Params, Remat, hidden_states, lm_head_weight


def token_logprobs_from_logits(
    logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """log softmax(logits / temperature)[target] and the entropy of that distribution.

    logits: [..., vocab] (any float dtype; computed in float32); targets: [...] int.
    Returns (logprobs [...] float32, entropy [...] float32).
    """
    z = logits.astype(jnp.float32)
    if temperature != 1.0:
        z = z / jnp.float32(temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(z - lse[..., None])
    entropy = lse - jnp.sum(probs * z, axis=-1)
    return picked - lse, entropy


def _head_logprobs(
    hidden: jax.Array, targets: jax.Array, w: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    logits = jnp.einsum("...h,hv->...v", hidden, w, preferred_element_type=jnp.float32)
    return token_logprobs_from_logits(logits, targets, temperature=temperature)


@overload
def logprobs(
    params: Params,
    tokens: jax.Array,
    *,
    config: ModelConfig,
    positions: jax.Array | None = ...,
    attention: AttentionFn | None = ...,
    attention_context: Any = ...,
    temperature: float = ...,
    return_entropy: Literal[False] = ...,
    remat: Remat = ...,
    chunk_size: int | None = ...,
) -> jax.Array: ...


@overload
def logprobs(
    params: Params,
    tokens: jax.Array,
    *,
    config: ModelConfig,
    positions: jax.Array | None = ...,
    attention: AttentionFn | None = ...,
    attention_context: Any = ...,
    temperature: float = ...,
    return_entropy: Literal[True],
    remat: Remat = ...,
    chunk_size: int | None = ...,
) -> tuple[jax.Array, jax.Array]: ...


def logprobs(
    params: Params,
    tokens: jax.Array,
    *,
    config: ModelConfig,
    positions: jax.Array | None = None,
    attention: AttentionFn | None = None,
    attention_context: Any = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    remat: Remat = None,
    chunk_size: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) from one forward pass.

    tokens: [batch, seq] int32. positions: [batch, seq] int32; when None it is
    `positions_from_valid(attention_context.valid)` for a `DenseContext`, else 0..seq-1.
    temperature: logits are divided by it before the softmax (match the sampler's).
    chunk_size: when set, the vocabulary projection and softmax run over `chunk_size`
    positions at a time and are recomputed in the backward pass, so the full
    [batch, seq, vocab] float32 logits are never held in memory.

    Returns logprobs [batch, seq-1] float32, and with return_entropy=True also the entropy
    of each predictive distribution, [batch, seq-1] float32. Entries whose target is
    padding are meaningless; mask them with the caller's loss mask.
    """
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [batch, seq] with seq >= 2, got shape {tokens.shape}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be positive")
    if positions is None:
        if isinstance(attention_context, DenseContext):
            positions = positions_from_valid(attention_context.valid)
        else:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = hidden_states(
        params,
        tokens,
        positions,
        config=config,
        attention=attention,
        attention_context=attention_context,
        remat=remat,
    )
    hidden, targets = hidden[:, :-1], tokens[:, 1:]
    w = lm_head_weight(params, config).astype(hidden.dtype)
    if chunk_size is None:
        lp, ent = _head_logprobs(hidden, targets, w, temperature)
    else:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int or None")
        b, s, h = hidden.shape
        n = -(-s // chunk_size)
        pad = n * chunk_size - s
        hid = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk_size, h).swapaxes(0, 1)
        tgt = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk_size).swapaxes(0, 1)
        step = jax.checkpoint(lambda xs: _head_logprobs(xs[0], xs[1], w, temperature))
        lp, ent = jax.lax.map(step, (hid, tgt))
        lp = lp.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :s]
        ent = ent.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :s]
    return (lp, ent) if return_entropy else lp
