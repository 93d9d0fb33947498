"""Packed updates (`rlax_trainer.packing`): the layout shows each rollout exactly its own
tokens, and an update from packed rows equals the update from padded rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlax_model
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, preset
from rlax_trainer.packing import best_layout, candidate_lengths, pack_minibatches


def grouped_batch(
    seed: int, b: int = 8, s: int = 16, group: int = 4, prompt: int = 4
) -> dict[str, np.ndarray]:
    """Right-padded rollouts whose groups share a prompt (and, in group 0, a first reply token)."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((b, s), np.int32)
    valid = np.zeros((b, s), bool)
    mask = np.zeros((b, s - 1), np.float32)
    for g in range(b // group):
        head = rng.integers(3, 32, size=prompt + (1 if g == 0 else 0))
        for i in range(g * group, (g + 1) * group):
            n = prompt + int(rng.integers(2, s - prompt + 1))
            tokens[i, :n] = rng.integers(3, 32, size=n)
            tokens[i, : len(head)] = head
            valid[i, :n] = True
            mask[i, prompt - 1 : n - 1] = 1.0
    mask[1, prompt + 1] = 0.0  # an environment token inside a reply (multi-turn)
    return {
        "tokens": tokens,
        "valid": valid,
        "mask": mask,
        "worker_logprobs": (-rng.uniform(1.0, 5.0, size=(b, s - 1)) * mask).astype(np.float32),
        "rewards": rng.integers(0, 2, size=b).astype(np.float32),
        "versions": np.zeros(b, np.int32),
    }


@pytest.mark.parametrize(
    "minibatches,length,align", [(1, 16, 1), (2, 16, 1), (1, 32, 1), (2, 64, 1), (1, 64, 4), (2, 48, 8)]
)
def test_every_rollout_sees_exactly_its_own_tokens(minibatches, length, align):
    """For every position t of every rollout, the packed query that predicts token t+1 sits at
    position t, holds token t, and attends to exactly the rollout's tokens 0..t; aligned
    packing (`batch_invariant`) puts every real token at an index equal to its position
    modulo `align`."""
    batch = grouped_batch(0)
    b = batch["tokens"].shape[0]
    order = np.random.default_rng(1).permutation(b)
    layout = pack_minibatches(batch["tokens"], batch["valid"], order, minibatches, 4, length, align)
    real = layout.segment > 0
    index = np.broadcast_to(np.arange(length), layout.tokens.shape)
    np.testing.assert_array_equal((index % align)[real], (layout.positions % align)[real])
    assert layout.tokens.shape == (minibatches, b // minibatches, length)
    lengths = batch["valid"].sum(1)
    for m in range(minibatches):
        for j, r in enumerate(order[m * b // minibatches : (m + 1) * b // minibatches]):
            row = layout.seq_row[m, j]
            assert row < layout.rows_used[m]
            ctx = rlax_model.PackedContext(
                segment=jnp.asarray(layout.segment[m, row])[None],
                parent=jnp.asarray(layout.parent[m, row])[None],
                positions=jnp.asarray(layout.positions[m, row])[None],
            )
            visible = np.asarray(rlax_model.attention.packed_mask(ctx))[0, 0]  # [L, L]
            for t in range(lengths[r] - 1):
                q = layout.source[m, j, t]
                assert layout.tokens[m, row, q] == batch["tokens"][r, t]
                assert layout.positions[m, row, q] == t
                keys = np.flatnonzero(visible[q])
                np.testing.assert_array_equal(layout.positions[m, row, keys], np.arange(t + 1))
                np.testing.assert_array_equal(layout.tokens[m, row, keys], batch["tokens"][r, : t + 1])


def test_a_group_shares_one_prefix_per_row_and_the_best_length_wins():
    batch = grouped_batch(2, b=8, s=16, group=8, prompt=8)
    tokens, valid = batch["tokens"], batch["valid"]
    layout = best_layout(tokens, valid, np.arange(8), 1, 8, candidate_lengths(16))
    real = int(valid.sum())
    # The 8-token prompt is computed once per row used, not once per rollout.
    assert layout.computed_tokens < real
    assert (layout.segment > 0).sum() <= real - 8 * 8 + 8 * int(layout.rows_used[0])
    if layout.rows_used.max() == 1:
        assert layout.tokens.shape[1] == 1  # one row: the single-pass program's shapes
    with pytest.raises(ValueError, match="more than the longest packed row 16"):
        best_layout(np.ones((8, 20), np.int32), np.ones((8, 20), bool), np.arange(8), 1, 8, [16])
    with pytest.raises(ValueError, match="right padding"):
        left = np.zeros((8, 16), bool)
        left[:, 4:] = True
        pack_minibatches(tokens, left, np.arange(8), 1, 8, 32)


def test_a_tie_in_positions_goes_to_the_layout_with_fewer_rows():
    """Two rows of 16 or one of 32 compute the same 32 positions; the one row wins: a
    minibatch of several rows runs the accumulating program (a second gradient buffer)."""
    tokens = np.zeros((8, 16), np.int32)
    valid = np.zeros((8, 16), bool)
    tokens[:, :4] = [5, 6, 7, 8]  # the group's prompt
    tokens[:, 4:7] = np.arange(8)[:, None] * 3 + 10 + np.arange(3)  # 8 replies of 3, distinct
    valid[:, :7] = True
    for length in (16, 32):
        alone = best_layout(tokens, valid, np.arange(8), 1, 8, [length])
        assert alone.computed_tokens == 32 and int(alone.rows_used[0]) == 32 // length
    layout = best_layout(tokens, valid, np.arange(8), 1, 8, candidate_lengths(16))
    assert layout.tokens.shape == (1, 1, 32) and layout.computed_tokens == 32


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


CASES = {
    "grpo, one minibatch (pi_old from the gradient pass)": dict(objective=preset("grpo")),
    "grpo, 2 minibatches of rows, TIS (a separate pi_old pass)": dict(
        objective=preset("grpo", importance={"tis_cap": 1.5}), minibatches=2
    ),
    "gspo, 2 minibatches (sequence-level ratio)": dict(objective=preset("gspo"), minibatches=2),
    "grpo + KL to the reference": dict(objective=preset("grpo", kl={"coef": 0.1})),
    "ppo (value head)": dict(objective=preset("ppo")),
    "top-p sampling (pi_old on the sampler's support)": dict(
        objective=preset("grpo", importance={"correction": {"kind": "tis", "upper": 2.0}}), top_p=0.9
    ),
    "sft": dict(mode="sft", objective=None),
}


# Two cases in the default suite (one pi_old from the gradient pass, one from its own pass on
# the sampler's support); the rest in `nox -s slow`, to keep the default suite under 15 minutes.
DEFAULT_CASES = {
    "grpo, one minibatch (pi_old from the gradient pass)",
    "top-p sampling (pi_old on the sampler's support)",
}


@pytest.mark.parametrize(
    "case", [case if case in DEFAULT_CASES else pytest.param(case, marks=pytest.mark.slow) for case in CASES]
)
def test_a_packed_update_equals_the_padded_update(case, model_config, model_params):
    batch = grouped_batch(3)
    # Adam's eps well above float32 noise: a coordinate whose gradient is ~0 on both sides
    # would otherwise take a full +-lr step in the direction of its rounding error.
    kw = dict(group_size=4, global_batch=8, optimizer=OptimizerConfig(lr=1e-2, eps=1e-3), **CASES[case])
    if kw.get("mode") == "sft":
        kw["group_size"] = 1
    padded = Learner(model_config, LearnerConfig(**kw, packing=False), model_params)
    packed = Learner(model_config, LearnerConfig(**kw), model_params)
    for learner in (padded, packed):
        learner.update(batch)
    metrics = [lr.update(grouped_batch(4)) for lr in (padded, packed)]  # a second step, other rows
    moved = np.abs(flat(padded.host_params()["policy"]) - flat(model_params)).max()
    assert moved > 1e-3  # the weights moved: the comparison can see a wrong gradient
    diff = np.abs(flat(packed.host_params()) - flat(padded.host_params())).max()
    assert diff < 1e-3 * moved, (diff, moved)
    for key in ("loss", "grad_norm", "entropy", "clip_fraction", "logprob_delta_p50", "value_loss"):
        if key in metrics[0]:
            assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-5), key
    assert metrics[1]["train_compute_ratio"] < metrics[0]["train_compute_ratio"]
    assert 0 < metrics[1]["train_token_efficiency"] <= 1


@pytest.mark.slow  # test_learner's precompiled-lengths test covers the same rule in the default suite
def test_precompiled_packed_programs_serve_the_steps(model_config, model_params):
    """The few packed programs (row lengths x one row or several) compile ahead, and a step
    that meets one compiles nothing."""
    cfg = LearnerConfig(objective=preset("grpo"), group_size=4, global_batch=8)
    learner = Learner(model_config, cfg, model_params)
    for future in learner.precompile([8, 16]):
        future.result()
    for seed in (5, 6):
        assert learner.update(grouped_batch(seed))["trainer_compile_seconds"] == 0.0
    short = grouped_batch(7)
    short["valid"][:, 6:] = False
    short["mask"][:, 5:] = 0.0
    short["tokens"][:, 6:] = 0
    assert learner.update(short)["trainer_compile_seconds"] == 0.0
    learner.stop_precompile()


def test_an_update_reports_weights_it_could_not_donate(model_config, model_params):
    """`trainer_undonated_mb`: a live host view of the weights (a push still holding them)
    keeps the update from reusing their buffers; once the view is gone it reuses them."""
    learner = Learner(
        model_config, LearnerConfig(objective=preset("grpo"), group_size=4, global_batch=8), model_params
    )
    assert learner.update(grouped_batch(0))["trainer_undonated_mb"] == 0.0
    views = learner.host_params()  # zero-copy on the CPU
    held = learner.update(grouped_batch(1))["trainer_undonated_mb"]
    total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(views)) / 2**20
    assert held == pytest.approx(total)
    del views
    assert learner.update(grouped_batch(2))["trainer_undonated_mb"] == 0.0
