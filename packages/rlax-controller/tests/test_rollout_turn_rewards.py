"""A trajectory's per-turn rewards through the controller: the verifier's score is the last
turn's reward when the environment gave none at the end, the sample's reward is the sum of
its turns', and the batch the trainer gets carries every turn."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from test_step_boundaries import Rig

from rlax_controller.rollout_results import RolloutResults, scored_sample
from rlax_protocol.messages import GenerateResult, Sample

TOKENS = (4, 5, 6, 8, 9)  # model turn, environment turn, model turn
MASK = (1, 0, 0, 1, 1)


def trajectory(turn_rewards: tuple[float, ...], env_reward: float | None, first: int = 4) -> Sample:
    return Sample(
        token_ids=(first, *TOKENS[1:]),
        logprobs=(-0.5, 0.0, 0.0, -0.5, -0.5),
        finish_reason="stop",
        model_mask=MASK,
        turns=2,
        tool_calls=1,
        end="answer",
        env_reward=env_reward,
        turn_ends=(0, 4),
        turn_rewards=turn_rewards,
    )


@pytest.mark.parametrize(
    ("turn_rewards", "env_reward", "verifier", "paid", "reward"),
    [
        ((0.0, 0.0), None, 1.0, (0.0, 1.0), 1.0),  # only the verifier: as before
        ((0.25, 0.0), None, 1.0, (0.25, 1.0), 1.25),  # no reward overwrites another
        ((0.25, 0.5), 0.5, 1.0, (0.25, 0.5), 0.75),  # the environment's last reward stands
        ((-0.5, 2.0), 2.0, 0.0, (-0.5, 2.0), 1.5),
    ],
)
def test_the_verifier_pays_the_last_turn_when_the_environment_does_not(
    turn_rewards, env_reward, verifier, paid, reward
) -> None:
    scored = scored_sample(trajectory(turn_rewards, env_reward), verifier, True)
    assert (scored.turn_ends, scored.turn_rewards, scored.reward) == ((0, 4), paid, reward)


def test_a_sample_without_per_turn_rewards_is_scored_as_before() -> None:
    single = Sample(token_ids=(4, 5), logprobs=(-0.5, -0.5), finish_reason="stop")
    scored = scored_sample(single, 1.0, True)
    assert (scored.reward, scored.turn_ends, scored.turn_rewards) == (1.0, (), ())
    # A worker from before per-turn rewards: its environment's reward, else the verifier's.
    old = Sample(token_ids=TOKENS, logprobs=(-0.5,) * 5, finish_reason="stop", model_mask=MASK, turns=2)
    assert scored_sample(old, 0.0, False).reward == 0.0
    rewarded = Sample(token_ids=TOKENS, logprobs=(-0.5,) * 5, finish_reason="stop", env_reward=0.5)
    assert scored_sample(rewarded, 1.0, True).reward == 0.5


def test_the_trainers_batch_carries_every_turns_reward(tmp_path: pathlib.Path, toy: Any) -> None:
    rig = Rig(tmp_path, toy)
    try:
        results = RolloutResults(rig.scheduler, rig.evaluations, toy.Scorer(), rig.tally)
        for _, group in rig.scheduler.assign(["worker0"]):
            assert group.request_id is not None
            # The parity scorer pays 1.0 for an even first token of the last model turn (8, 9).
            samples = (trajectory((0.25, 0.0), None), trajectory((0.5, -1.0), -1.0, first=3))
            results.take_result(
                "worker0", GenerateResult(request_id=group.request_id, samples=samples, weight_version=0)
            )
        train = rig.boundaries.train_batch(rig.scheduler.build_batch())
    finally:
        rig.metrics.close()
    assert [(r.turn_ends, r.turn_rewards, r.reward) for r in train.rollouts] == [
        ((0, 4), (0.25, 1.0), 1.25),
        ((0, 4), (0.5, -1.0), -0.5),
    ] * 2
