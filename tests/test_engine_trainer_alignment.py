"""The engine's aligned mode against the trainer's `batch_invariant` update: same-version
float32 log-probs agree to the bit (issue 28).

`LLMEngine` (`EngineConfig(aligned=True)`) samples rollouts from a tiny random model through
its paged prefill (chunked, a chunk starting off the key block) and decode; a `Learner`
with `batch_invariant=True` recomputes every sampled token's log-prob in its update from
the same weights and reports the largest difference (`logprob_mismatch_max`), which must be
exactly 0. The cases cover grouped-query and one-query-head-per-KV-head attention (whose
decode matmuls have one row per KV head unless padded), tied and untied output
projections, and the packed and padded update. Without the mode the same rollouts differ
(measured on these two cases, largest difference: 7.6e-6 and 9.1e-6 with both sides in
their default mode; 3.9e-5 and 1.1e-5 with only the trainer batch-invariant).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import rlax_model
from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_trainer import Learner, LearnerConfig, preset

SAMPLES = 4
NEW = 24
CASES = {
    "gqa-untied-packed": (dict(num_heads=4, num_kv_heads=2), True),
    "mha-tied-padded": (dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_and_trainer_logprobs_agree_to_the_bit_in_aligned_mode(case: str) -> None:
    shape, packing = CASES[case]
    config = rlax_model.ModelConfig.tiny(vocab_size=256, **shape)
    # A large init scale: peaked, varied distributions, where rounding differences show.
    params = rlax_model.init_params(config, jax.random.key(1), std=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (37, 21)]
    engine = LLMEngine(
        config, params,
        EngineConfig(
            block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
            eos_token_ids=(), prefill_chunk_size=24, aligned=True,
        ),
    )  # fmt: skip
    outs = engine.generate(
        prompts, SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW, seed=5, ignore_eos=True)
    )
    rows = [(p, s) for p, o in zip(prompts, outs, strict=True) for s in o.outputs]
    width = max(len(p) + NEW for p, _ in rows)
    b = len(rows)
    tokens = np.zeros((b, width), np.int32)
    valid = np.zeros((b, width), bool)
    mask = np.zeros((b, width - 1), np.float32)
    worker = np.zeros((b, width - 1), np.float32)
    for i, (prompt, sample) in enumerate(rows):
        n = len(prompt) + len(sample.tokens)
        tokens[i, :n] = list(prompt) + list(sample.tokens)
        valid[i, :n] = True
        mask[i, len(prompt) - 1 : n - 1] = 1.0  # position t predicts token t + 1
        worker[i, len(prompt) - 1 : n - 1] = sample.logprobs
    learner = Learner(
        config,
        LearnerConfig(
            objective=preset("grpo"),
            group_size=SAMPLES,
            global_batch=b,
            packing=packing,
            batch_invariant=True,
        ),
        params,
    )
    metrics = learner.update(
        {
            "tokens": tokens,
            "valid": valid,
            "mask": mask,
            "worker_logprobs": worker,
            "rewards": rng.random(b).astype(np.float32),
            "versions": np.zeros(b, np.int32),  # the weights the update starts from: same version
        }
    )
    assert metrics["on_policy_tokens"] == mask.sum() == b * NEW
    assert metrics["logprob_mismatch_max"] == 0.0, metrics["logprob_mismatch_max"]


def test_trainer_batch_invariant_turns_on_the_workers_aligned_mode() -> None:
    """One run-config switch: `trainer.batch_invariant` sets both the learner's option and
    the aligned mode of every worker's engine; off by default on both."""
    from rlax_core.config import load_config
    from rlax_inference.worker_process import engine_config_fields
    from rlax_trainer.trainer_process import learner_config

    for overrides, want in (([], False), (["trainer.batch_invariant=true"], True)):
        config = load_config(None, overrides)
        assert EngineConfig(**engine_config_fields(config, 1)).aligned is want
        assert learner_config(config, mode="rl").batch_invariant is want


def test_a_multi_turn_rollout_agrees_to_the_bit_across_its_turns() -> None:
    """Two model turns with environment tokens between them, as an agent loop makes them: the
    second turn's prompt (first prompt + first reply + tool output) is prefilled on top of the
    first turn's cached blocks (prefix cache, a partial last block), and the trainer scores
    both turns' tokens in one row, the environment's masked out."""
    config = rlax_model.ModelConfig.tiny(vocab_size=256, num_heads=4, num_kv_heads=2)
    params = rlax_model.init_params(config, jax.random.key(2), std=0.3)
    rng = np.random.default_rng(1)
    engine = LLMEngine(
        config, params,
        EngineConfig(
            block_size=16, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=160,
            eos_token_ids=(), aligned=True,
        ),
    )  # fmt: skip
    turn = SamplingParams(n=1, temperature=1.0, max_tokens=13, seed=7, ignore_eos=True)
    rows = []  # per rollout: tokens, per-position model mask, per-position engine log-prob
    for i, n in enumerate((29, 18, 40, 23)):
        prompt = rng.integers(3, config.vocab_size, n).tolist()
        (first,) = engine.generate([prompt], turn)[0].outputs
        tool = rng.integers(3, config.vocab_size, 5 + i).tolist()
        context = [*prompt, *first.tokens, *tool]
        (second,) = engine.generate([context], turn)[0].outputs
        tokens = [*context, *second.tokens]
        mask = np.zeros(len(tokens) - 1, np.float32)
        logprobs = np.zeros(len(tokens) - 1, np.float32)
        for start, sample in ((len(prompt), first), (len(context), second)):
            mask[start - 1 : start - 1 + len(sample.tokens)] = 1.0
            logprobs[start - 1 : start - 1 + len(sample.tokens)] = sample.logprobs
        rows.append((tokens, mask, logprobs))
    assert engine.num_prefix_cache_hit_tokens > 0  # the second turns reused the first turns' blocks
    width = max(len(t) for t, _, _ in rows)
    b = len(rows)
    batch = {
        "tokens": np.zeros((b, width), np.int32),
        "valid": np.zeros((b, width), bool),
        "mask": np.zeros((b, width - 1), np.float32),
        "worker_logprobs": np.zeros((b, width - 1), np.float32),
        "rewards": rng.random(b).astype(np.float32),
        "versions": np.zeros(b, np.int32),
    }
    for i, (tokens, mask, logprobs) in enumerate(rows):
        batch["tokens"][i, : len(tokens)] = tokens
        batch["valid"][i, : len(tokens)] = True
        batch["mask"][i, : len(mask)] = mask
        batch["worker_logprobs"][i, : len(mask)] = logprobs
    learner = Learner(
        config,
        LearnerConfig(
            objective=preset("grpo"), group_size=b, global_batch=b, packing=True, batch_invariant=True
        ),
        params,
    )
    metrics = learner.update(batch)
    assert metrics["on_policy_tokens"] == batch["mask"].sum() == b * 2 * 13
    assert metrics["logprob_mismatch_max"] == 0.0, metrics["logprob_mismatch_max"]
