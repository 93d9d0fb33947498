"""Per-token log-probabilities (and entropies) of given sequences, shared by trainer and engine."""

from __future__ import annotations

from typing import Any, Literal, overload

import jax
import jax.numpy as jnp

from rlax_model.attention import AttentionFn, DenseContext, positions_from_valid
from rlax_model.config import ModelConfig
from rlax_model.layers import ordered_sum, row_matmul
from rlax_model.transformer import Params, Remat, hidden_states, lm_head_weight


def token_logprobs_from_logits(
    logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """log softmax(logits / temperature)[target] and the entropy of that distribution.

    logits: [..., vocab] (any float dtype; computed in float32); targets: [...] int.
    Returns (logprobs [...] float32, entropy [...] float32).
    The sums over the vocabulary are `ordered_sum`s, so a token's values do not depend on
    how many other tokens are computed with it (batch invariance).
    """
    z = logits.astype(jnp.float32)
    if temperature != 1.0:
        z = z / jnp.float32(temperature)
    # The max is exact in any order; stop_gradient as in jax.nn.logsumexp (it cancels).
    top = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = (jnp.log(ordered_sum(jnp.exp(z - top))) + top)[..., 0]
    picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(z - lse[..., None])
    entropy = lse - ordered_sum(probs * z)[..., 0]
    return picked - lse, entropy


def _head_logprobs(
    hidden: jax.Array, targets: jax.Array, w: jax.Array, temperature: float
) -> tuple[jax.Array, jax.Array]:
    logits = row_matmul(hidden, w)
    return token_logprobs_from_logits(logits, targets, temperature=temperature)


def head_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    w: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    scored: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target and the entropy under softmax(hidden @ w / temperature).

    hidden: [batch, seq, hidden]; targets: [batch, seq] int; w: [hidden, vocab].
    chunk_size: when set, the projection and softmax run over `chunk_size` tokens (of the
    flattened batch x seq) at a time and are recomputed in the backward pass, so neither
    the forward nor the backward ever holds the full [batch, seq, vocab] float32 logits,
    only a few [chunk_size, vocab] ones.
    scored: [batch, seq] bool, the positions whose values are wanted (a loss mask). With
    chunks, the scored positions are gathered to the front and a chunk holding none is
    skipped, forward and backward: prompt and padding positions (most of an RL batch of
    short replies) cost no vocabulary projection. Unscored positions return 0.
    Returns (logprobs [batch, seq] float32, entropy [batch, seq] float32).
    """
    if chunk_size is None:
        lp, ent = _head_logprobs(hidden, targets, w, temperature)
        if scored is not None:
            lp, ent = jnp.where(scored, lp, 0.0), jnp.where(scored, ent, 0.0)
        return lp, ent
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int or None")
    # Chunks run over the flattened batch x seq tokens, so a chunk's logits are
    # [chunk_size, vocab] whatever the batch size (a per-row chunk would still be [B, c, V]).
    lead = targets.shape
    hid = hidden.reshape(-1, hidden.shape[-1])
    tgt = targets.reshape(-1)
    total = tgt.shape[0]
    order = None
    if scored is not None:
        flag = scored.reshape(-1).astype(bool)
        order = jnp.argsort(~flag, stable=True)  # scored positions first, in their order
        hid, tgt, flag = hid[order], tgt[order], flag[order]
    n = -(-total // chunk_size)
    pad = n * chunk_size - total
    hid = jnp.pad(hid, ((0, pad), (0, 0))).reshape(n, chunk_size, hid.shape[-1])
    tgt = jnp.pad(tgt, (0, pad)).reshape(n, chunk_size)

    def chunk(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        return _head_logprobs(xs[0], xs[1], w, temperature)

    if order is None:
        # checkpoint: the backward recomputes each chunk's logits instead of keeping all n.
        lp, ent = jax.lax.map(jax.checkpoint(chunk), (hid, tgt))
    else:
        live = jnp.pad(flag, (0, pad)).reshape(n, chunk_size).any(axis=1)  # [n] bool

        def maybe(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
            zeros = jnp.zeros(xs[1].shape, jnp.float32)
            # jax.lax.cond's result is typed Any: name the pair's type.
            picked: tuple[jax.Array, jax.Array] = jax.lax.cond(xs[2], chunk, lambda _: (zeros, zeros), xs[:2])
            return picked

        lp, ent = jax.lax.map(jax.checkpoint(maybe), (hid, tgt, live))
    lp, ent = lp.reshape(-1)[:total], ent.reshape(-1)[:total]
    if order is not None:
        back = jnp.argsort(order)  # the inverse permutation: a gather, cheap to differentiate
        lp = jnp.where(flag[back], lp[back], 0.0)
        ent = jnp.where(flag[back], ent[back], 0.0)
    return lp.reshape(lead), ent.reshape(lead)


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
    scored: jax.Array | None = ...,
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
    scored: jax.Array | None = ...,
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
    scored: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) from one forward pass.

    tokens: [batch, seq] int32. positions: [batch, seq] int32; when None it is
    `positions_from_valid(attention_context.valid)` for a `DenseContext`, else 0..seq-1.
    temperature: logits are divided by it before the softmax (match the sampler's).
    chunk_size: when set, the vocabulary projection and softmax run over `chunk_size`
    tokens (of batch x seq) at a time and are recomputed in the backward pass, so the full
    [batch, seq, vocab] float32 logits are never held in memory.
    scored: [batch, seq-1] bool, the log-probs wanted (e.g. the loss mask); with chunks, the
    others are never projected onto the vocabulary and come back 0 (`head_logprobs`).

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
    lp, ent = head_logprobs(
        hidden[:, :-1], tokens[:, 1:], w, temperature=temperature, chunk_size=chunk_size, scored=scored
    )
    return (lp, ent) if return_entropy else lp
