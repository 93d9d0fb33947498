"""The agent loop carries the environment's verdict on a trajectory's tool use
(`EnvStep.tool_correct`) to `Sample.tool_correct`: the last step's verdict that is not
None, None when no step judged, and a verdict that is not a bool fails its step alone.

The scripted environment and the tiny-model engine are those of `test_agent_loop.py`:
model turns of 6 tokens, environment turns of 3 and 2 tokens, done after the third turn.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_agent_loop import IdCodec, ScriptedEnv, Step, drive, make_engine, prompt_of, request

import rlax_protocol as rp
from rlax_inference.agent_loop import AgentLoop


@dataclasses.dataclass
class JudgedStep(Step):
    tool_correct: Any = None


class JudgingEnv(ScriptedEnv):
    """The scripted environment, its k-th step judging the tool use `verdicts[k]`."""

    def __init__(self, verdicts: tuple[Any, ...]) -> None:
        super().__init__()
        self.verdicts = verdicts

    def step(self, model_turn: str) -> JudgedStep:
        step = super().step(model_turn)
        return JudgedStep(**dataclasses.asdict(step), tool_correct=self.verdicts[len(self.turns_seen) - 1])


def run(make_env: Any, *, max_turns: int = 3, n: int = 2) -> tuple[list[rp.Sample], AgentLoop]:
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(make_env=make_env), max_model_len=128)
    req, params = request(prompt_of(20, seed=5), max_turns=max_turns, n=n)
    loop.start(0, req, params)
    [(_, _, samples, _)] = drive(engine, loop)
    return samples, loop


@pytest.mark.parametrize(
    ("verdicts", "max_turns", "want", "end"),
    [
        # Calls are not yet used (False); the answering step gives the verdict.
        ((False, False, True), 3, True, "answer"),
        ((False, False, False), 3, False, "answer"),
        # A step that cannot tell (None) keeps the verdict before it.
        ((False, True, None), 3, True, "answer"),
        # Cut short at max_turns: the last step that ran (the second) gives the verdict.
        ((False, False, True), 2, False, "max_turns"),
        # No step judged: the environment cannot tell.
        ((None, None, None), 3, None, "answer"),
    ],
)
def test_the_last_verdict_that_is_not_none_reaches_the_sample(verdicts, max_turns, want, end):
    samples, _ = run(lambda: JudgingEnv(verdicts), max_turns=max_turns)
    for sample in samples:
        assert (sample.tool_correct, sample.end) == (want, end)
        # It crosses the wire to the controller.
        assert rp.decode(rp.encode(sample)).tool_correct is want


def test_an_environment_without_the_field_gives_none():
    samples, _ = run(ScriptedEnv)
    assert [(s.tool_correct, s.end) for s in samples] == [(None, "answer")] * 2


def test_a_verdict_that_is_not_a_bool_fails_its_step_alone():
    samples, loop = run(lambda: JudgingEnv(("yes", True, True)), n=1)
    [sample] = samples
    assert (sample.end, sample.tool_correct, sample.tool_errors) == ("error", None, 1)
    assert loop.tool_error_counts == {"step_crash": 1}
