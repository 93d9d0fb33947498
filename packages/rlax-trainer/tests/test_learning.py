"""GRPO really learns: a tiny random model learns to answer each prompt with its digit pattern.

One process: the inference engine (rlax_inference.LLMEngine, paged KV cache) samples groups
with per-request seeds and reports its logprobs; the trainer recomputes pi_old itself,
updates, and hands the new weights (version = step) back to the engine.
"""

from __future__ import annotations

import jax
import numpy as np

import rlax_model
from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_protocol import Rollout
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, RolloutBuffer, collate, preset

VOCAB, PROMPTS, G, LEN, BOS = 10, 4, 16, 4, 9
# The vocabulary is the ten digits. Prompt p is [BOS, p]; its answer is the pattern TARGETS[p];
# the reward is the fraction of the 4 answer digits in place (a random policy scores ~0.1).
TARGETS = np.array([[1, 2, 3, 4], [9, 8, 7, 6], [2, 4, 6, 8], [5, 5, 0, 0]], np.int32)


def reward(prompt: int, completion: np.ndarray) -> float:
    return float((completion == TARGETS[prompt]).mean())


CONFIG = rlax_model.ModelConfig.tiny(
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


def generate_and_score(engine: LLMEngine, learner: Learner, buffer: RolloutBuffer, step: int) -> float:
    """One group of G samples per prompt from the engine (seeded by `step`), scored and added
    to `buffer`; every sample must come from the learner's current version. -> mean reward."""
    prompts = [[BOS, p] for p in range(PROMPTS)]
    outs = engine.generate(prompts, SamplingParams(n=G, temperature=1.0, max_tokens=LEN, seed=1000 + step))
    rewards = []
    for p, out in enumerate(outs):
        assert out.weight_version == learner.step
        group = []
        for j, c in enumerate(out.outputs):
            r = reward(p, np.asarray(c.tokens))
            rewards.append(r)
            group.append(
                Rollout(
                    prompt_id=f"p{p}",
                    group_index=j,
                    prompt_token_ids=tuple(prompts[p]),
                    completion_token_ids=tuple(c.tokens),
                    worker_logprobs=tuple(c.logprobs),
                    policy_version=out.weight_version,
                    reward=r,
                )
            )
        buffer.add(group, current_version=learner.step)
    return float(np.mean(rewards))


def test_grpo_learns_digit_patterns():
    config = CONFIG
    params = rlax_model.init_params(config, jax.random.key(0))
    cfg = LearnerConfig(
        objective=preset("grpo", kl={"coef": 0.0}),
        group_size=G,
        global_batch=PROMPTS * G,
        minibatches=2,
        optimizer=OptimizerConfig(lr=3e-3, max_grad_norm=1.0),
    )
    learner = Learner(config, cfg, params, seed=0)
    engine = LLMEngine(
        config, params, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=PROMPTS * G, max_model_len=16)
    )
    buffer = RolloutBuffer(group_size=G, max_staleness=0)
    history = []
    for step in range(150):
        history.append(generate_and_score(engine, learner, buffer, step))
        metrics = learner.update(collate(buffer.take(PROMPTS, learner.step), pad_id=0))
        # One model definition on both sides: the engine's logprobs match the trainer's own pass.
        assert metrics["logprob_delta_max"] < 1e-3, metrics
        engine.update_weights(learner.policy_params(), learner.step)
        if step >= 5 and np.mean(history[-5:]) > 0.6:
            break
    print(f"mean reward per step: {[round(h, 2) for h in history]}")
    assert history[0] < 0.2, history
    assert np.mean(history[-5:]) > 0.5, history
