"""Per-turn rewards on the wire (`Sample` and `Rollout`: `turn_ends`, `turn_rewards`): they
round-trip, messages written before them still decode, and impossible values are refused
with a message that names the field, whether built here or forged by a peer."""

from __future__ import annotations

import msgspec
import pytest

import rlax_protocol as rp
from rlax_protocol.control_messages import TrainBatch, decode_control, encode_control

TRAJECTORY = dict(
    token_ids=(5, 6, 7, 8, 9, 10),
    logprobs=(-0.1, -0.2, 0.0, 0.0, -0.3, -0.4),
    finish_reason="stop",
    model_mask=(1, 1, 0, 0, 1, 1),
    turns=2,
    tool_calls=1,
    end="answer",
)
ROLLOUT = dict(
    prompt_id="p",
    group_index=0,
    prompt_token_ids=(1, 2),
    completion_token_ids=(5, 6, 7, 8, 9, 10),
    worker_logprobs=(-0.1, -0.2, 0.0, 0.0, -0.3, -0.4),
    policy_version=3,
    completion_mask=(1, 1, 0, 0, 1, 1),
)


def test_per_turn_rewards_round_trip() -> None:
    sample = rp.Sample(**TRAJECTORY, env_reward=1.0, turn_ends=(1, 5), turn_rewards=(0.25, 1.0))
    result = rp.GenerateResult(request_id="r", samples=(sample,), weight_version=3)
    assert rp.decode(rp.encode(result)) == result
    rollout = rp.Rollout(**ROLLOUT, reward=1.25, turn_ends=(1, 5), turn_rewards=(0.25, 1.0))
    batch = TrainBatch(step=0, group_size=1, rollouts=(rollout,), rollout_ids=("a",))
    assert decode_control(encode_control(batch)) == batch  # as the trainer's journal holds it


@pytest.mark.parametrize(
    ("type_name", "fields"),
    [("Sample", {**TRAJECTORY, "env_reward": 0.5}), ("Rollout", {**ROLLOUT, "reward": 0.5})],
)
def test_a_message_written_before_per_turn_rewards_still_decodes(type_name: str, fields: dict) -> None:
    old = msgspec.msgpack.encode({"type": type_name, **fields})  # no turn_ends / turn_rewards
    message = rp.decode(old)
    assert (message.turn_ends, message.turn_rewards) == ((), ())


BAD = [
    ({"turn_ends": (1, 5), "turn_rewards": (0.5,)}, "turn_rewards", "one per turn end"),
    ({"turn_ends": (1, 5), "turn_rewards": (0.5, float("nan"))}, "turn_rewards", "must be finite"),
    ({"turn_ends": (1, 5), "turn_rewards": (0.5, float("inf"))}, "turn_rewards", "must be finite"),
    ({"turn_ends": (5, 1), "turn_rewards": (0.5, 0.5)}, "turn_ends", "must follow the previous"),
    ({"turn_ends": (1, 1), "turn_rewards": (0.5, 0.5)}, "turn_ends", "must follow the previous"),
    ({"turn_ends": (1, 6), "turn_rewards": (0.5, 0.5)}, "turn_ends", "index one of the 6 tokens"),
    ({"turn_ends": (-1,), "turn_rewards": (0.5,)}, "turn_ends", "index one of the 6 tokens"),
    ({"turn_ends": (1, 3), "turn_rewards": (0.5, 0.5)}, "turn_ends", "not a model token"),
]


@pytest.mark.parametrize(("turns", "field", "why"), BAD)
def test_impossible_per_turn_rewards_are_refused_naming_the_field(turns: dict, field: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"Sample\.{field}=.*{why}"):
        rp.Sample(**TRAJECTORY, **turns)
    with pytest.raises(ValueError, match=rf"Rollout\.{field}=.*{why}"):
        rp.Rollout(**ROLLOUT, **turns)
    # As a hostile peer would send it: built by hand, refused by the decoder.
    forged = msgspec.msgpack.encode({"type": "Sample", **TRAJECTORY, **turns})
    with pytest.raises(rp.MalformedMessageError, match=rf"Sample\.{field}"):
        rp.decode(forged)


def test_turn_rewards_must_agree_with_the_samples_other_fields() -> None:
    with pytest.raises(ValueError, match=r"Sample\.turn_ends=.*more than `turns` \(1\)"):
        rp.Sample(**{**TRAJECTORY, "turns": 1}, turn_ends=(1, 5), turn_rewards=(0.0, 0.0))
    with pytest.raises(ValueError, match=r"Sample\.turn_rewards=.*must be env_reward \(1\.0\)"):
        rp.Sample(**TRAJECTORY, env_reward=1.0, turn_ends=(1, 5), turn_rewards=(0.0, 0.5))
    with pytest.raises(ValueError, match=r"Rollout\.reward=.*must be the sum of turn_rewards \(1\.5\)"):
        rp.Rollout(**ROLLOUT, reward=1.0, turn_ends=(1, 5), turn_rewards=(0.5, 1.0))
    # Without a model mask every token is the model's; a sample without an env reward may
    # carry any last-turn reward (the controller adds the verifier's score there).
    plain = {k: v for k, v in TRAJECTORY.items() if k != "model_mask"}
    assert rp.Sample(**plain, turn_ends=(2, 3), turn_rewards=(0.5, 0.0)).turn_ends == (2, 3)


def test_a_partial_rollout_s_token_versions_round_trip_and_are_checked() -> None:
    """`Rollout.token_versions` (partial rollouts): one per completion token, the oldest the
    rollout's `policy_version`."""
    rollout = rp.Rollout(**ROLLOUT, reward=1.0, token_versions=(3, 3, 3, 4, 4, 4))
    batch = TrainBatch(step=5, group_size=1, rollouts=(rollout,), rollout_ids=("a",))
    assert decode_control(encode_control(batch)) == batch
    with pytest.raises(ValueError, match="token_versions.*one per completion token"):
        rp.Rollout(**ROLLOUT, reward=1.0, token_versions=(3, 4))
    with pytest.raises(ValueError, match="token_versions.*oldest must be policy_version"):
        rp.Rollout(**ROLLOUT, reward=1.0, token_versions=(4,) * 6)
