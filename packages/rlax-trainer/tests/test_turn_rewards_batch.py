"""Per-turn rewards from the wire to the update: `collate` lays each turn's reward at the
logprob index of its last token, and the learner hands them to the objective, which
reads them with `credit: per_turn` and ignores them (to the bit) with the default."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_protocol import Rollout
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, preset
from rlax_trainer.buffer import collate, one_turn_layout
from rlax_trainer.objective import prepare_batch

G = 4


def rollout(index: int, completion: tuple[int, ...], reward: float, **fields) -> Rollout:
    return Rollout(
        prompt_id="p",
        group_index=index,
        prompt_token_ids=(1, 2, 3),
        completion_token_ids=completion,
        worker_logprobs=tuple(-0.5 * m for m in fields.get("completion_mask", (1,) * len(completion))),
        policy_version=0,
        reward=reward,
        **fields,
    )


def test_collate_pays_each_turn_at_its_last_token_and_other_rollouts_at_their_last() -> None:
    group = [
        # Two model turns (completion tokens 0-1 and 4), an environment turn between.
        rollout(
            0,
            (5, 6, 7, 8, 9),
            1.5,
            completion_mask=(1, 1, 0, 0, 1),
            turn_ends=(1, 4),
            turn_rewards=(0.5, 1.0),
        ),
        rollout(1, (5, 6, 7), 2.0),  # single-turn
        rollout(2, (5, 6, 7, 8), -1.0, completion_mask=(1, 0, 1, 0)),  # multi-turn, one reward
        rollout(3, (5, 6), 0.0, completion_mask=(0, 0)),  # no model token: nothing paid
    ]
    batch = collate([group], seq_len=9)
    # Completion token j of a 3-token prompt is scored at logprob index 2 + j.
    assert list(np.flatnonzero(batch.turn_ends[0])) == [3, 6]
    np.testing.assert_array_equal(batch.token_rewards[0], [0, 0, 0, 0.5, 0, 0, 1.0, 0])
    np.testing.assert_array_equal(batch.token_rewards[1], [0, 0, 0, 0, 2.0, 0, 0, 0])
    np.testing.assert_array_equal(batch.turn_ends[1], batch.token_rewards[1] != 0)
    np.testing.assert_array_equal(batch.token_rewards[2], [0, 0, 0, 0, -1.0, 0, 0, 0])
    assert not batch.turn_ends[3].any() and not batch.token_rewards[3].any()
    np.testing.assert_array_equal(batch.rewards, [1.5, 2.0, -1.0, 0.0])
    assert (batch.turn_ends <= batch.mask).all()  # every turn end is a trained token
    # A batch built without `collate` gets the same one-turn layout for rows without turns.
    token_rewards, turn_ends = one_turn_layout(batch.rewards, batch.mask)
    np.testing.assert_array_equal(token_rewards[1:], batch.token_rewards[1:])
    np.testing.assert_array_equal(turn_ends[1:], batch.turn_ends[1:])


def multi_turn(batch: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """`batch` (conftest's `random_batch`) with each completion of >= 3 tokens cut into two
    model turns by an environment token, each turn paid a reward; `rewards` their sums."""
    rng = np.random.default_rng(seed)
    mask = batch["mask"].copy()
    token_rewards, turn_ends = np.zeros_like(mask), np.zeros_like(mask)
    for b, row in enumerate(mask):
        on = np.flatnonzero(row)
        if len(on) >= 3:
            mask[b, on[1]] = 0.0  # the environment's token
            turn_ends[b, on[0]] = 1.0
            token_rewards[b, on[0]] = rng.normal()
        turn_ends[b, on[-1]] = 1.0
        token_rewards[b, on[-1]] = rng.integers(0, 2)
    return dict(
        batch,
        mask=mask,
        worker_logprobs=batch["worker_logprobs"] * mask,
        token_rewards=token_rewards,
        turn_ends=turn_ends,
        rewards=token_rewards.sum(axis=1).astype(np.float32),
    )


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def config(**objective) -> LearnerConfig:
    return LearnerConfig(
        objective=preset("grpo", importance={"tis_cap": None}, **objective),
        group_size=G,
        global_batch=8,
        optimizer=OptimizerConfig(lr=1e-3, max_grad_norm=1.0),
    )


def test_the_update_ignores_per_turn_arrays_by_default_and_reads_them_per_turn(
    model_config, model_params, make_batch
) -> None:
    batch = multi_turn(make_batch(11), seed=11)
    # Without the arrays the learner pays each row's reward at its last token (one turn).
    without = {k: v for k, v in batch.items() if k not in ("token_rewards", "turn_ends")}
    runs = {}
    for name, cfg, arrays in (
        ("trajectory", config(), batch),
        ("trajectory_without_turns", config(), without),
        ("per_turn", config(credit={"assignment": "per_turn", "gamma": 0.5}), batch),
    ):
        learner = Learner(model_config, cfg, model_params)
        runs[name] = (learner.update(arrays), flat(learner.host_params()))
    # The default: every metric and weight the same to the bit, arrays or none.
    np.testing.assert_array_equal(runs["trajectory"][1], runs["trajectory_without_turns"][1])
    assert runs["trajectory"][0]["advantage_std"] == runs["trajectory_without_turns"][0]["advantage_std"]
    # Per turn: the objective's advantages of these very arrays (the learner's metric is
    # each row's mean advantage over its tokens), and another update.
    cfg = config(credit={"assignment": "per_turn", "gamma": 0.5}).objective
    assert cfg is not None
    adv = np.asarray(
        prepare_batch(
            cfg,
            batch["rewards"],
            batch["mask"],
            G,
            token_rewards=batch["token_rewards"],
            turn_ends=batch["turn_ends"],
        ).advantages
    )
    row_mean = (adv * batch["mask"]).sum(1) / batch["mask"].sum(1)
    metrics = runs["per_turn"][0]
    assert metrics["advantage_mean"] == pytest.approx(row_mean.mean(), abs=1e-5)
    assert metrics["advantage_std"] == pytest.approx(row_mean.std(), abs=1e-5)
    assert metrics["advantage_std"] != pytest.approx(runs["trajectory"][0]["advantage_std"], abs=1e-3)
    assert not np.array_equal(runs["per_turn"][1], runs["trajectory"][1])
