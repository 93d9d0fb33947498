"""Top-p/top-k semantics of the off-policy correction, at the learner level.

The engine's sampler (`rlax_inference.sampler.sample`) reports the log-prob of the token
under the truncated, renormalised distribution it drew from. Here a tiny model generates
with that very sampler (top-p and top-k on, temperature != 1), and the learner, with the
same params (on-policy, version 0), must recompute pi_old on the same support: the
behaviour weight pi_prox / pi_behav is then 1 up to float rounding, and MIS with a tight
band masks nothing. The full-distribution log-probs of the same tokens differ from the
engine's (so a learner that skipped the mask would fail here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rlax_model
from rlax_inference.sampler import SamplingBatch, sample
from rlax_trainer import Learner, LearnerConfig, preset
from rlax_trainer.learner import sampler_logprobs

B, PROMPT, NEW = 8, 3, 7
TEMPERATURE = 0.8


def _generate(model_config, params, top_p: float, top_k: int):
    """Tokens [B, PROMPT + NEW] and the sampler's logprobs of the generated ones [B, NEW]."""
    rng = np.random.default_rng(0)
    s = PROMPT + NEW
    tokens = np.zeros((B, s), np.int32)
    tokens[:, :PROMPT] = rng.integers(3, model_config.vocab_size, size=(B, PROMPT))

    @jax.jit
    def draw(tokens, at, step):
        # Causal attention: the logits at `at` see only the tokens up to it (the rest is filler).
        valid = jnp.ones(tokens.shape, bool)
        positions = rlax_model.positions_from_valid(valid)
        ctx = rlax_model.DenseContext(valid=valid)
        hidden, _ = rlax_model.hidden_states(
            params, tokens, positions, config=model_config, attention_context=ctx
        )
        logits = rlax_model.project_logits(hidden[:, at], params, model_config)
        rows = jnp.arange(B)
        batch = SamplingBatch(
            jnp.full((B,), TEMPERATURE, jnp.float32),
            jnp.full((B,), top_p, jnp.float32),
            jnp.full((B,), top_k, jnp.int32),
            jnp.full((B,), 7, jnp.uint32),
            rows.astype(jnp.int32),
            jnp.full((B,), step, jnp.int32),
        )
        return sample(logits, batch)  # what the engine reports

    logprobs = np.zeros((B, NEW), np.float32)
    for step in range(NEW):
        out = draw(tokens, PROMPT - 1 + step, step)
        tokens[:, PROMPT + step] = np.asarray(out.tokens)
        logprobs[:, step] = np.asarray(out.logprobs)
    return tokens, logprobs


def test_on_policy_behaviour_weight_is_one_with_top_p(model_config, model_params):
    top_p, top_k = 0.8, 6  # both filters bind (top-k 6 of 32, then top-p)
    tokens, engine_lp = _generate(model_config, model_params, top_p, top_k)
    s = tokens.shape[1]
    mask = np.zeros((B, s - 1), np.float32)
    mask[:, PROMPT - 1 :] = 1.0  # position t predicts token t + 1
    worker = np.zeros((B, s - 1), np.float32)
    worker[:, PROMPT - 1 :] = engine_lp

    # The same tokens' full-distribution log-probs differ from the engine's: the data exercises the mask.
    full = rlax_model.logprobs(
        model_params, jnp.asarray(tokens), config=model_config, temperature=TEMPERATURE
    )
    assert np.abs(np.asarray(full)[:, PROMPT - 1 :] - engine_lp).max() > 0.05

    cfg = LearnerConfig(
        objective=preset(
            "grpo", importance={"correction": {"kind": "mis", "upper": 1.0001, "lower": 0.9999}}
        ),
        group_size=4,
        global_batch=B,
        temperature=TEMPERATURE,
        top_p=top_p,
        top_k=top_k,
        logprob_chunk_size=16,  # several chunks, one padded
    )
    learner = Learner(model_config, cfg, model_params)
    m = learner.update(
        {
            "tokens": tokens.astype(np.int32),
            "valid": np.ones((B, s), bool),
            "mask": mask,
            "worker_logprobs": worker,
            "rewards": np.tile([1.0, 0.0, 0.0, 1.0], 2).astype(np.float32),
            "versions": np.zeros((B,), np.int32),
        }
    )
    assert m["on_policy_tokens"] == mask.sum()
    assert m["logprob_mismatch_max"] <= 2e-6, m["logprob_mismatch_max"]
    assert abs(m["behav_ratio_max"] - 1.0) <= 2e-6 and abs(m["behav_ratio_min"] - 1.0) <= 2e-6, m
    assert m["behav_corrected_fraction"] == 0.0 and m["behav_corrected_seq_fraction"] == 0.0
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_sampler_logprobs_mask_ties_and_off_support():
    """Hand-worked: logits (2, 1, 1, 0, -inf-ish) at T = 1, top-k 3 then top-p 0.8.

    Top-3 keeps (2, 1, 1) (the tie broken by index, as a stable sort does), p = (0.576,
    0.212, 0.212); before-mass (0, 0.576, 0.788) < 0.8 keeps all three: log-prob of token 1
    = 1 - log(e^2 + 2e) = -1.5514. top_p 0.7 keeps (2, 1@1): token 2 is off the support (-inf),
    token 1 gets 1 - log(e^2 + e) = -1.3133.
    """
    logits = jnp.array([[2.0, 1.0, 1.0, 0.0, -30.0]] * 3)
    targets = jnp.array([1, 2, 0])
    lp = sampler_logprobs(logits, targets, temperature=1.0, top_p=0.8, top_k=3)
    np.testing.assert_allclose(lp, [-1.5514, -1.5514, 2 - np.log(np.e**2 + 2 * np.e)], atol=1e-4)
    lp = sampler_logprobs(logits, targets, temperature=1.0, top_p=0.7, top_k=3)
    np.testing.assert_allclose(np.asarray(lp)[[0, 2]], [-1.3133, 2 - np.log(np.e**2 + np.e)], atol=1e-4)
    assert np.asarray(lp)[1] == -np.inf
