"""GRPO really learns: a tiny random model learns to answer each prompt with its digit pattern.

The inference engine is not used here yet: `sample` below is a minimal jitted sampling loop
over `rlax_model.forward` (full recompute per token, no KV cache). It should move to the
engine (rlax_inference) once that exists, as the issue asks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import rlax_model
from rlax_protocol import Rollout
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, RolloutBuffer, collate, preset

VOCAB, PROMPTS, G, LEN, BOS = 10, 4, 16, 4, 9
# The vocabulary is the ten digits. Prompt p is [BOS, p]; its answer is the pattern TARGETS[p];
# the reward is the fraction of the 4 answer digits in place (a random policy scores ~0.1).
TARGETS = np.array([[1, 2, 3, 4], [9, 8, 7, 6], [2, 4, 6, 8], [5, 5, 0, 0]], np.int32)


def reward(prompt: int, completion: np.ndarray) -> float:
    return float((completion == TARGETS[prompt]).mean())


@functools.partial(jax.jit, static_argnames=("config",))
def sample(params, prompts: jax.Array, key: jax.Array, *, config: rlax_model.ModelConfig):
    """prompts: [B, P] int32 -> (completions [B, LEN] int32, logprobs [B, LEN] float32)."""
    b, p = prompts.shape
    tokens = jnp.concatenate([prompts, jnp.zeros((b, LEN), jnp.int32)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(p + LEN, dtype=jnp.int32), tokens.shape)

    def step(t, carry):
        tokens, lps, key = carry
        key, sub = jax.random.split(key)
        logits, _ = rlax_model.forward(params, tokens, positions, config=config)
        nxt_logits = jax.lax.dynamic_index_in_dim(logits, p + t - 1, axis=1, keepdims=False)
        tok = jax.random.categorical(sub, nxt_logits).astype(jnp.int32)
        lp = jax.nn.log_softmax(nxt_logits)[jnp.arange(b), tok]
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, p + t, axis=1)
        lps = jax.lax.dynamic_update_index_in_dim(lps, lp, t, axis=1)
        return tokens, lps, key

    tokens, lps, _ = jax.lax.fori_loop(0, LEN, step, (tokens, jnp.zeros((b, LEN), jnp.float32), key))
    return tokens[:, p:], lps


def test_grpo_learns_digit_patterns():
    config = rlax_model.ModelConfig.tiny(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        bos_token_id=BOS,
        eos_token_id=None,
    )
    params = rlax_model.init_params(config, jax.random.key(0))
    cfg = LearnerConfig(
        objective=preset("grpo", kl={"coef": 0.0}),
        group_size=G,
        global_batch=PROMPTS * G,
        minibatches=2,
        optimizer=OptimizerConfig(lr=3e-3, max_grad_norm=1.0),
    )
    learner = Learner(config, cfg, params, seed=0)
    buffer = RolloutBuffer(group_size=G, max_staleness=0)
    prompts = np.array([[BOS, i] for i in range(PROMPTS) for _ in range(G)], np.int32)
    key = jax.random.key(1)
    history = []
    for step in range(150):
        key, sub = jax.random.split(key)
        completions, lps = jax.device_get(
            sample(learner.policy_params(), jnp.asarray(prompts), sub, config=config)
        )
        rewards = [reward(i // G, completions[i]) for i in range(len(prompts))]
        history.append(float(np.mean(rewards)))
        for g in range(PROMPTS):
            buffer.add(
                [
                    Rollout(
                        prompt_id=f"p{g}",
                        group_index=j,
                        prompt_token_ids=tuple(int(t) for t in prompts[g * G + j]),
                        completion_token_ids=tuple(int(t) for t in completions[g * G + j]),
                        worker_logprobs=tuple(float(x) for x in lps[g * G + j]),
                        policy_version=learner.step,
                        reward=rewards[g * G + j],
                    )
                    for j in range(G)
                ],
                current_version=learner.step,
            )
        groups = buffer.take(PROMPTS, learner.step)
        metrics = learner.update(collate(groups, pad_id=0))
        assert metrics["logprob_delta_max"] < 1e-3, "trainer and sampler share one model: logprobs must agree"
        if step >= 5 and np.mean(history[-5:]) > 0.6:
            break
    assert history[0] < 0.2, history
    assert np.mean(history[-5:]) > 0.5, history
