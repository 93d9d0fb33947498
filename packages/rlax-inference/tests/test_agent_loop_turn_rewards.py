"""The agent loop records every model turn's reward with the turn: the reward of the step
that answered it, at the turn's last token (`Sample.turn_ends`, `turn_rewards`); no reward
overwrites another, and `env_reward` is the last step's alone.

The scripted environment and the tiny-model engine are those of `test_agent_loop.py`:
model turns of 6 tokens, environment turns of 3 and 2 tokens, done after the third turn.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_agent_loop import IdCodec, ScriptedEnv, Step, drive, make_engine, prompt_of, request

import rlax_protocol as rp
from rlax_inference.agent_loop import AgentLoop


class RewardingEnv(ScriptedEnv):
    """The scripted environment, its k-th step paying `rewards[k]` (None: no reward)."""

    def __init__(self, rewards: tuple[float | None, ...]) -> None:
        super().__init__()
        self.rewards = rewards

    def step(self, model_turn: str) -> Step:
        step = super().step(model_turn)
        return dataclasses.replace(step, reward=self.rewards[len(self.turns_seen) - 1])


@pytest.mark.parametrize(
    ("rewards", "max_turns", "turn_rewards", "env_reward", "end"),
    [
        ((0.25, None, 1.0), 3, (0.25, 0.0, 1.0), 1.0, "answer"),
        # The last step pays nothing: the verifier will score the answer; earlier rewards stay.
        ((0.25, -0.5, None), 3, (0.25, -0.5, 0.0), None, "answer"),
        # The step after the last allowed turn still runs, and pays that turn.
        ((0.5, 2.0, 9.0), 2, (0.5, 2.0), 2.0, "max_turns"),
    ],
)
def test_every_turns_reward_is_recorded_at_its_last_token(rewards, max_turns, turn_rewards, env_reward, end):
    engine = make_engine()
    codec = IdCodec(make_env=lambda: RewardingEnv(rewards))
    loop = AgentLoop(lambda: engine, codec, max_model_len=128)
    req, params = request(prompt_of(20, seed=3), max_turns=max_turns)
    loop.start(0, req, params)
    [(_, _, samples, _)] = drive(engine, loop)
    # Model turns of 6 tokens at 0-5, 9-14 and 17-22 (environment turns of 3 and 2 between).
    ends = (5, 14, 22)[:max_turns]
    for sample in samples:
        assert (sample.turn_ends, sample.turn_rewards) == (ends, turn_rewards)
        assert (sample.env_reward, sample.end, sample.turns) == (env_reward, end, max_turns)
        for e in sample.turn_ends:  # each end is a model token that closes its turn
            assert sample.model_mask[e] == 1 and (
                e + 1 == len(sample.token_ids) or sample.model_mask[e + 1] == 0
            )
        assert rp.decode(rp.encode(sample)) == sample
