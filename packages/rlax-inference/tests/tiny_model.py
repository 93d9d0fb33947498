"""A tiny random Llama and a cache-free greedy decoder used as the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_model import DenseContext, ModelConfig, forward, init_params, logprobs

CONFIG = ModelConfig.tiny(max_position_embeddings=512)
# A larger init scale than the default gives peaked distributions: greedy ties cannot hide bugs.
PARAMS = init_params(CONFIG, jax.random.key(0), std=0.25)
PAD_TO = 128


@functools.partial(jax.jit, static_argnames=("config",))
def _last_logits(params, tokens, length, *, config):
    valid = jnp.arange(tokens.shape[1])[None, :] < length
    logits, _ = forward(
        params,
        tokens,
        jnp.arange(tokens.shape[1])[None, :],
        config=config,
        attention_context=DenseContext(valid),
    )
    return logits[0, length - 1]


def naive_greedy(params, prompt, max_tokens, *, config=CONFIG, eos=(), pad_to=PAD_TO):
    """Greedy decoding by re-running the whole sequence each step (no KV cache)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        row = np.zeros((1, pad_to), np.int32)
        row[0, : len(tokens)] = tokens
        tok = int(jnp.argmax(_last_logits(params, row, len(tokens), config=config)))
        tokens.append(tok)
        if tok in eos:
            break
    return tokens[len(prompt) :]


@functools.partial(jax.jit, static_argnames=("config", "temperature"))
def _teacher_forced(params, tokens, length, *, config, temperature):
    valid = jnp.arange(tokens.shape[1])[None, :] < length
    return logprobs(
        params, tokens, config=config, attention_context=DenseContext(valid), temperature=temperature
    )[0]


def teacher_forced_logprobs(params, prompt, completion, *, config=CONFIG, temperature=1.0, pad_to=PAD_TO):
    """log p(completion[t] | prompt + completion[:t]) from one full forward pass (no cache)."""
    full = list(prompt) + list(completion)
    row = np.zeros((1, max(pad_to, len(full))), np.int32)
    row[0, : len(full)] = full
    lp = _teacher_forced(params, row, len(full), config=config, temperature=temperature)
    return np.asarray(lp[len(prompt) - 1 : len(full) - 1])
