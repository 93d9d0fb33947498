"""Batch-invariant log-probs: the trainer's float32 log-probs of a rollout are bitwise the same
whatever it is padded to, batched with, or packed with (`batch_invariant`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlax_model
from rlax_trainer import LearnerConfig, preset
from rlax_trainer.learner_passes import UpdateSpec, packed_outputs, policy_outputs
from rlax_trainer.packing import pack_minibatches

VOCAB = 64
PROMPT = 21  # not a multiple of the key block: the packer must cut the shared prefix


@pytest.fixture(scope="module")
def setup():
    config = rlax_model.dtype_policy(
        rlax_model.ModelConfig.tiny(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8,
        )
    )  # fmt: skip
    # A large init scale: peaked, varied logits, so that rounding differences would show.
    params = {"policy": rlax_model.init_params(config, jax.random.key(0), std=0.3)}
    cfg = LearnerConfig(objective=preset("grpo"), group_size=4, global_batch=4, batch_invariant=True)
    spec = UpdateSpec(config, cfg)
    # The update's compiler options under batch_invariant (`learner_update.batch_update_jit_aligned`).
    options = rlax_model.layers.ALIGNED_COMPILER_OPTIONS
    padded = jax.jit(
        lambda p, t, v, s: policy_outputs(spec, p, t, v, s, remat=False)[0],
        compiler_options=options,
    )
    packed = jax.jit(
        lambda p, row, src, tg, s: packed_outputs(spec, p, row, src, tg, s, remat=False)[0],
        compiler_options=options,
    )
    return params, padded, packed


def _rows(seqs: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens and valid [len(seqs), width]."""
    tokens = np.zeros((len(seqs), width), np.int32)
    valid = np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        valid[i, : len(s)] = True
    return tokens, valid


def padded_logprobs(setup, seqs: list[np.ndarray], width: int, at: int) -> np.ndarray:
    """The padded pass's log-probs of seqs[at] (its n-1 predicted tokens), batched with the others."""
    params, padded, _ = setup
    tokens, valid = _rows(seqs, width)
    lp = padded(params, tokens, valid, valid[:, 1:])
    return np.asarray(lp)[at, : len(seqs[at]) - 1]


def packed_logprobs(setup, seqs: list[np.ndarray], group_size: int, length: int, at: int):
    """-> (the packed pass's log-probs of seqs[at], from the row the batch-invariant packer put
    it in; the layout)."""
    params, _, packed = setup
    tokens, valid = _rows(seqs, max(len(s) for s in seqs))
    order = np.arange(len(seqs))
    layout = pack_minibatches(
        tokens, valid, order, 1, group_size, length, align=rlax_model.attention.KEY_BLOCK
    )
    j = int(layout.seq_row[0, at])
    row = {k: jnp.asarray(getattr(layout, k)[0, j]) for k in ("tokens", "segment", "parent", "positions")}
    scored = valid[:, 1:] & (layout.seq_row[0] == j)[:, None]
    lp = packed(params, row, layout.source[0], tokens[:, 1:], scored)
    return np.asarray(lp)[at, : len(seqs[at]) - 1], layout


def test_a_rollouts_logprobs_are_bitwise_the_same_however_it_is_padded_batched_or_packed(setup):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, VOCAB, PROMPT)

    def rollout(n: int) -> np.ndarray:
        return np.concatenate([prompt, rng.integers(3, VOCAB, n - PROMPT)]).astype(np.int32)

    x = rollout(45)  # crosses two key blocks
    siblings = [rollout(n) for n in (30, 52, 24)]  # the same prompt: a group with x
    strangers = [rng.integers(3, VOCAB, n).astype(np.int32) for n in (40, 61, 9)]

    reference = padded_logprobs(setup, [x], 45, 0)  # alone, no padding
    results = {
        "padded to 48, batched with one other": padded_logprobs(setup, [x, strangers[0]], 48, 0),
        "padded to 128, third of four": padded_logprobs(setup, [*strangers[:2], siblings[0], x], 128, 3),
        "padded to 70, with its group": padded_logprobs(setup, [*siblings, x], 70, 3),
    }
    results["packed alone at a row's start"] = packed_logprobs(
        setup, [x, strangers[2], strangers[0], strangers[1]], 1, 128, 0
    )[0]
    # Last of a group of 4 sharing the prompt, packed after another group: x's segment sits
    # after its siblings' and attends to the group's shared prefix copy.
    group_last, layout = packed_logprobs(setup, [*strangers[:2], *strangers[:2], *siblings, x], 4, 256, 7)
    # The layout shares a prefix and puts x away from the row's start: what this case is for.
    j = layout.seq_row[0, 7]
    assert (layout.parent[0, j] != layout.segment[0, j]).any()
    assert layout.source[0, 7, PROMPT] > PROMPT
    results["packed last of its group, prefix shared"] = group_last
    # Another batch: x first of its group, other rollouts packed after the group.
    results["packed first of its group in another batch"] = packed_logprobs(
        setup, [x, *siblings, strangers[2], strangers[1], strangers[2], strangers[0]], 4, 128, 0
    )[0]
    for name, lp in results.items():
        assert lp.dtype == np.float32
        assert np.array_equal(lp, reference), (name, float(np.abs(lp - reference).max()))
