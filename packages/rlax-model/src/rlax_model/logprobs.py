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


def head_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    w: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target and the entropy under softmax(hidden @ w / temperature).

    hidden: [batch, seq, hidden]; targets: [batch, seq] int; w: [hidden, vocab].
    chunk_size: when set, the projection and softmax run over `chunk_size` tokens (of the
    flattened batch x seq) at a time and are recomputed in the backward pass, so neither
    the forward nor the backward ever holds the full [batch, seq, vocab] float32 logits,
    only a few [chunk_size, vocab] ones.
    Returns (logprobs [batch, seq] float32, entropy [batch, seq] float32).
    """
    if chunk_size is None:
        return _head_logprobs(hidden, targets, w, temperature)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int or None")
    # Chunks run over the flattened batch x seq tokens, so a chunk's logits are
    # [chunk_size, vocab] whatever the batch size (a per-row chunk would still be [B, c, V]).
    lead = targets.shape
    hid = hidden.reshape(-1, hidden.shape[-1])
    tgt = targets.reshape(-1)
    total = tgt.shape[0]
    n = -(-total // chunk_size)
    pad = n * chunk_size - total
    hid = jnp.pad(hid, ((0, pad), (0, 0))).reshape(n, chunk_size, hid.shape[-1])
    tgt = jnp.pad(tgt, (0, pad)).reshape(n, chunk_size)
    # checkpoint: the backward recomputes each chunk's logits instead of keeping all n of them.
    step = jax.checkpoint(lambda xs: _head_logprobs(xs[0], xs[1], w, temperature))
    lp, ent = jax.lax.map(step, (hid, tgt))
    lp = lp.reshape(-1)[:total].reshape(lead)
    ent = ent.reshape(-1)[:total].reshape(lead)
    return lp, ent


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
    tokens (of batch x seq) at a time and are recomputed in the backward pass, so the full
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
    w = lm_head_weight(params, config).astype(hidden.dtype)
    lp, ent = head_logprobs(hidden[:, :-1], tokens[:, 1:], w, temperature=temperature, chunk_size=chunk_size)
    return (lp, ent) if return_entropy else lp
