"""The environment's verdict on a trajectory's tool use on the wire (`Sample.tool_correct`,
`EnvStepResult.tool_correct`): it round-trips, messages written before it still decode
(None: not judged), and a value that is not a bool or None is refused."""

from __future__ import annotations

import msgspec
import pytest

import rlax_protocol as rp

SAMPLE = dict(
    token_ids=(5, 6, 7), logprobs=(), finish_reason="stop", model_mask=(1, 0, 1), turns=2, end="answer"
)
STEP = dict(request_id="e1", observation="(3)", done=False, tool_calls=1)


@pytest.mark.parametrize("verdict", [True, False, None])
def test_the_verdict_round_trips(verdict: bool | None) -> None:
    result = rp.GenerateResult(
        request_id="r", samples=(rp.Sample(**SAMPLE, tool_correct=verdict),), weight_version=0
    )
    assert rp.decode(rp.encode(result)).samples[0].tool_correct is verdict
    step = rp.EnvStepResult(**STEP, tool_correct=verdict)
    assert rp.decode(rp.encode(step)).tool_correct is verdict


@pytest.mark.parametrize(("type_name", "fields"), [("Sample", SAMPLE), ("EnvStepResult", STEP)])
def test_a_message_written_before_the_verdict_decodes_as_not_judged(type_name: str, fields: dict) -> None:
    old = msgspec.msgpack.encode({"type": type_name, **fields})
    assert rp.decode(old).tool_correct is None


def test_a_forged_verdict_is_refused() -> None:
    forged = msgspec.msgpack.encode({"type": "Sample", **SAMPLE, "tool_correct": "yes"})
    with pytest.raises(rp.MalformedMessageError, match="tool_correct"):
        rp.decode(forged)
