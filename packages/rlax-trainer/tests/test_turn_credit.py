"""Per-turn credit assignment (`credit: per_turn`) against an independent float64 reference,
and `credit: trajectory` (the default) exactly as before.

The reference below is written from the formulas of `turn_credit.py`'s docstring with
Python loops over each trajectory's list of turns; it never reads the arrays the library
gets (`token_rewards`, `turn_ends`), only the turn lists they are made from, and never
calls the library.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import msgspec
import numpy as np
import pytest

from rlax_trainer.objective import (
    GAE,
    PRESET_NAMES,
    BatchNormalized,
    CreditConfig,
    GroupCentered,
    GroupNormalized,
    LeaveOneOut,
    ObjectiveConfig,
    ValueConfig,
    objective_from_dict,
    objective_to_dict,
    prepare_batch,
    preset,
    register_advantage,
    shape_rewards,
)

G, NG = 4, 3
B = G * NG


@dataclasses.dataclass(frozen=True)
class Turn:
    start: int  # first token of the model turn (logprob index)
    end: int  # its last token
    reward: float


def ragged_layout(seed: int, *, max_turns: int = 4) -> tuple[list[list[Turn]], int]:
    """B rows of 1..max_turns model turns of 1-3 tokens, 1-2 environment tokens between
    turns, a prompt offset of 0-2; rewards sparse (30% exactly 0) and continuous otherwise.
    Each group's first row has one turn and its second `max_turns`, so turn indices are
    reached by different numbers of rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(B):
        count = (1, max_turns)[b % G] if b % G < 2 else int(rng.integers(1, max_turns + 1))
        position, turns = int(rng.integers(0, 3)), []
        for k in range(count):
            if k:
                position += int(rng.integers(1, 3))  # the environment's tokens
            length = int(rng.integers(1, 4))
            reward = 0.0 if rng.random() < 0.3 else float(rng.normal())
            turns.append(Turn(position, position + length - 1, reward))
            position += length
        rows.append(turns)
    return rows, max(t[-1].end for t in rows) + 1 + int(rng.integers(0, 3))


def arrays(rows: list[list[Turn]], t: int) -> dict[str, np.ndarray]:
    """What `collate` hands the learner: the mask, each turn's reward at its last token, the
    turn ends, and the sequence reward (the sum of the turns')."""
    mask, token_rewards, turn_ends = (np.zeros((B, t)) for _ in range(3))
    for b, turns in enumerate(rows):
        for turn in turns:
            mask[b, turn.start : turn.end + 1] = 1.0
            token_rewards[b, turn.end] = turn.reward
            turn_ends[b, turn.end] = 1.0
    rewards = np.array([sum(turn.reward for turn in turns) for turns in rows])
    return {"mask": mask, "token_rewards": token_rewards, "turn_ends": turn_ends, "rewards": rewards}


# --------------------------------------------------------------------- the float64 reference
def ref_returns(turns: list[Turn], gamma: float) -> list[float]:
    return [sum(gamma ** (j - k) * turns[j].reward for j in range(k, len(turns))) for k in range(len(turns))]


def ref_turn_advantages(rows: list[list[Turn]], gamma: float, estimator: object) -> list[list[float]]:
    """Per row, per turn: the advantage of the turn's return against turn k of its group."""
    returns = [ref_returns(turns, gamma) for turns in rows]

    def peers(b: int, k: int) -> list[float]:
        group = range(b // G * G, b // G * G + G)
        return [returns[i][k] for i in group if len(returns[i]) > k]

    out: list[list[float]] = []
    if isinstance(estimator, BatchNormalized):
        centred = [
            [
                ret - (np.mean(peers(b, k)) if estimator.subtract_group_mean else 0.0)
                for k, ret in enumerate(returns[b])
            ]
            for b in range(B)
        ]
        every = [x for row in centred for x in row]
        mean, std = np.mean(every), np.sqrt(np.mean([(x - np.mean(every)) ** 2 for x in every]))
        return [[(x - mean) / (std + estimator.eps) for x in row] for row in centred]
    for b in range(B):
        row = []
        for k, ret in enumerate(returns[b]):
            p = peers(b, k)
            n, mean = len(p), float(np.mean(p))
            if isinstance(estimator, GroupNormalized):
                std = np.sqrt(sum((x - mean) ** 2 for x in p) / (n - estimator.ddof)) if n > 1 else 0.0
                row.append((ret - mean) / (std + estimator.eps) if n > 1 else 0.0)
            elif isinstance(estimator, GroupCentered):
                row.append(ret - mean)
            elif isinstance(estimator, LeaveOneOut):
                row.append(ret - (sum(p) - ret) / (n - 1) if n > 1 else 0.0)
            else:
                raise AssertionError(f"no reference for {estimator!r}")
        out.append(row)
    return out


def ref_gae(rows: list[list[Turn]], values: np.ndarray, est: GAE, t: int) -> np.ndarray:
    """GAE over each row's model tokens in order (environment tokens are no actions): turn
    k's reward on its last token, the value after the last token 0."""
    adv = np.zeros((B, t))
    model = np.zeros((B, t), bool)
    for b, turns in enumerate(rows):
        tokens = [i for turn in turns for i in range(turn.start, turn.end + 1)]
        paid = {turn.end: turn.reward for turn in turns}
        following = 0.0
        for j in reversed(range(len(tokens))):
            i = tokens[j]
            next_value = values[b, tokens[j + 1]] if j + 1 < len(tokens) else 0.0
            delta = paid.get(i, 0.0) + est.gamma * next_value - values[b, i]
            following = delta + est.gamma * est.lam * following
            adv[b, i], model[b, i] = following, True
    if est.normalize:
        mean, std = adv[model].mean(), adv[model].std()
        adv = np.where(model, (adv - mean) / (std + est.eps), 0.0)
    return adv


def ref_token_advantages(rows: list[list[Turn]], per_turn: list[list[float]], t: int) -> np.ndarray:
    adv = np.zeros((B, t))
    for b, turns in enumerate(rows):
        for turn, a in zip(turns, per_turn[b], strict=True):
            adv[b, turn.start : turn.end + 1] = a
    return adv


def ref_dapo_penalty(length: int, max_length: int, cache_length: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens."""
    if length <= max_length - cache_length:
        return 0.0
    if length <= max_length:
        return (max_length - cache_length - length) / cache_length * penalty
    return -penalty


# --------------------------------------------------------------------- the library
def lib_advantages(
    cfg: ObjectiveConfig,
    x: dict[str, np.ndarray],
    values: np.ndarray | None = None,
    *,
    with_turns: bool = False,
) -> np.ndarray:
    """The library's per-token advantages [B, T] of a batch (its per-turn arrays passed when
    `with_turns`)."""
    j = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
    turns = {k: j[k] for k in ("token_rewards", "turn_ends")} if with_turns else {}
    old_values = None if values is None else jnp.asarray(values, jnp.float32)
    prep = prepare_batch(cfg, j["rewards"], j["mask"], G, old_values, **turns)
    return np.asarray(prep.advantages, np.float64)


def per_turn(estimator: object, gamma: float = 1.0) -> ObjectiveConfig:
    return ObjectiveConfig(
        advantage=estimator,  # type: ignore[arg-type]
        credit=CreditConfig(assignment="per_turn", gamma=gamma),
        value=ValueConfig() if getattr(estimator, "needs_values", False) else None,
    )


CRITIC_FREE = [
    GroupNormalized(),
    GroupNormalized(ddof=1, eps=1e-4),
    GroupCentered(),
    LeaveOneOut(),
    BatchNormalized(),
    BatchNormalized(subtract_group_mean=True),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("estimator", CRITIC_FREE, ids=repr)
def test_per_turn_advantages_match_the_float64_reference(estimator, gamma: float, seed: int) -> None:
    rows, t = ragged_layout(seed)
    assert {len(turns) for turns in rows} == {1, 2, 3, 4}
    got = lib_advantages(per_turn(estimator, gamma), arrays(rows, t), with_turns=True)
    want = ref_token_advantages(rows, ref_turn_advantages(rows, gamma, estimator), t)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(
    "estimator", [GAE(gamma=0.95, lam=0.9), GAE(gamma=1.0, lam=1.0, normalize=False)], ids=repr
)
def test_per_turn_gae_reads_each_turns_reward_at_its_last_token(estimator: GAE, seed: int) -> None:
    rows, t = ragged_layout(seed)
    values = np.random.default_rng(seed + 100).normal(size=(B, t))
    got = lib_advantages(per_turn(estimator), arrays(rows, t), values, with_turns=True)
    np.testing.assert_allclose(got, ref_gae(rows, values, estimator, t), rtol=2e-5, atol=2e-5)


def test_the_overlong_penalty_is_paid_with_the_last_turn() -> None:
    rows, t = ragged_layout(4)
    overlong = {"max_length": 8, "cache_length": 4, "penalty": 1.0}
    cfg = preset("dapo", overlong=overlong, credit={"assignment": "per_turn", "gamma": 0.8})
    paid = []
    for turns in rows:
        length = sum(turn.end - turn.start + 1 for turn in turns)
        last = dataclasses.replace(turns[-1], reward=turns[-1].reward + ref_dapo_penalty(length, **overlong))
        paid.append([*turns[:-1], last])
    assert any(p[-1].reward != r[-1].reward for p, r in zip(paid, rows, strict=True))  # some rows pay it
    want = ref_token_advantages(rows, ref_turn_advantages(paid, 0.8, GroupNormalized()), t)
    np.testing.assert_allclose(
        lib_advantages(cfg, arrays(rows, t), with_turns=True), want, rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_trajectory_credit_is_the_old_path_to_the_bit(name: str) -> None:
    """The default reads no per-turn arrays: the same advantages with or without them, and
    exactly those the estimator makes of the (shaped) sequence rewards, as before."""
    rows, t = ragged_layout(5)
    x = arrays(rows, t)
    cfg = preset(name)
    values = np.random.default_rng(5).normal(size=(B, t)) if cfg.value else None
    without = lib_advantages(cfg, x, values)
    with_turns = lib_advantages(cfg, x, values, with_turns=True)
    j = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
    old, _ = cfg.advantage.compute(
        shape_rewards(cfg, j["rewards"], j["mask"].sum(axis=1)),
        j["mask"],
        G,
        None if values is None else jnp.asarray(values, jnp.float32),
    )
    np.testing.assert_array_equal(with_turns, without)
    np.testing.assert_array_equal(without, np.asarray(old, np.float64))


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_one_turn_per_row_makes_per_turn_the_trajectory_path(name: str) -> None:
    rows, t = ragged_layout(6, max_turns=1)
    x = arrays(rows, t)
    base = preset(name)
    values = np.random.default_rng(6).normal(size=(B, t)) if base.value else None
    new = preset(name, credit={"assignment": "per_turn"})
    old_adv = lib_advantages(base, x, values)
    np.testing.assert_allclose(lib_advantages(new, x, values, with_turns=True), old_adv, rtol=1e-5, atol=1e-5)
    # Without per-turn arrays each row is one turn paid its reward at its last token.
    np.testing.assert_allclose(lib_advantages(new, x, values), old_adv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", CRITIC_FREE, ids=repr)
def test_terminal_rewards_and_equal_turn_counts_per_group_give_the_trajectory_advantages(estimator) -> None:
    """Old and new code paths on one multi-turn batch where they must agree: every reward at
    the last turn, gamma 1, and the rows of each group with as many turns (G_k = R). Group
    g's rows have g + 1 turns; batch whitening counts every turn of the batch once, so for
    it every row has 3 (else rows with more turns weigh more than in the trajectory path)."""
    rows = []
    for b in range(B):
        count = NG if isinstance(estimator, BatchNormalized) else 1 + b // G
        turns = [Turn(3 * k, 3 * k + 1, 0.0) for k in range(count)]
        rows.append([*turns[:-1], dataclasses.replace(turns[-1], reward=b % 3 + 0.25 * (b // G))])
    x = arrays(rows, 3 * NG)
    np.testing.assert_allclose(
        lib_advantages(per_turn(estimator), x, with_turns=True),
        lib_advantages(ObjectiveConfig(advantage=estimator), x),
        rtol=1e-5,
        atol=1e-6,
    )


def test_credit_round_trips_and_impossible_settings_are_refused() -> None:
    cfg = preset("rloo", credit={"assignment": "per_turn", "gamma": 0.9})
    assert (cfg.credit.assignment, cfg.credit.gamma) == ("per_turn", 0.9)
    assert objective_from_dict(objective_to_dict(cfg)) == cfg
    assert preset("grpo").credit.assignment == "trajectory"  # the default: every run before
    with pytest.raises(ValueError, match="needs `assignment: per_turn`"):
        preset("grpo", credit={"gamma": 0.9})
    with pytest.raises(ValueError, match=r"credit.gamma must be in \[0, 1\]"):
        preset("grpo", credit={"assignment": "per_turn", "gamma": 1.5})
    with pytest.raises(ValueError, match="advantage's own `gamma`"):
        preset("ppo", credit={"assignment": "per_turn", "gamma": 0.9})
    with pytest.raises(ValueError, match="assignment"):
        preset("grpo", credit={"assignment": "per_token"})


class SequenceOnly(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A user's estimator written before per-turn credit: `compute` alone."""

    kind: ClassVar[str] = "test_sequence_only"
    needs_values: ClassVar[bool] = False

    def compute(self, rewards, mask, group_size, values=None):
        return rewards[:, None] * mask, None


def test_an_estimator_without_a_per_turn_baseline_is_refused_for_per_turn_credit() -> None:
    register_advantage(SequenceOnly)
    assert ObjectiveConfig(advantage=SequenceOnly()).credit.assignment == "trajectory"
    with pytest.raises(ValueError, match="'test_sequence_only' has no per-turn baseline"):
        ObjectiveConfig(advantage=SequenceOnly(), credit=CreditConfig(assignment="per_turn"))
