"""Typed messages: round trips, validation naming the field, garbage and wrong types."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlax_protocol as rp
from rlax_protocol import MalformedMessageError, decode, decode_as, encode

SAMPLING = rp.SamplingParams(
    max_tokens=16, temperature=0.7, top_p=0.9, top_k=50, stop_token_ids=(2,), seed=3, top_logprobs=2
)
RESUMED_0 = rp.ResumedSample(sample_index=0, token_ids=(5,))
HEADER = rp.TensorHeader(
    name="layers/0/attn/q", dtype="bfloat16", shape=(4, 8), nbytes=64, checksum=2**64 - 1
)
MANIFEST = rp.TensorManifest(protocol_version=rp.PROTOCOL_VERSION, chunk_bytes=1 << 20, tensors=(HEADER,))

EXAMPLES: list[rp.Message] = [
    rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id="w0", role="worker"),
    rp.Welcome(protocol_version=rp.PROTOCOL_VERSION, server_id="ps"),
    rp.ErrorReply(code="malformed", message="bad"),
    rp.Ack(),
    HEADER,
    MANIFEST,
    rp.PushBegin(version=3, manifest=MANIFEST, metadata={"step": 3, "loss": 0.5, "tags": ["a"]}),
    rp.PushReady(push_id=1, max_message_bytes=1 << 26),
    rp.PushBegin(version=4, manifest=MANIFEST, local=True),
    rp.PushReady(
        push_id=2, max_message_bytes=1 << 26, staging_file="/run/state/.w.tmp-push-ab", data_offset=4096
    ),
    rp.PushChunks(push_id=1, first_frame=0, count=1),
    rp.PushCommit(push_id=1),
    rp.PushBegin(version=5, manifest=MANIFEST, checksums_follow=True),
    rp.PushCommit(push_id=3, checksums=(HEADER.checksum,)),
    rp.PushAbort(push_id=1),
    rp.Committed(version=3, persisted=True),
    rp.PullBegin(version=None, if_newer_than=2),
    rp.PullGranted(lease_id=4, version=3, manifest=MANIFEST, metadata={}, lease_ttl_s=30.0),
    rp.NotNewer(latest=3),
    rp.FetchChunks(lease_id=4, first_frame=0, count=1),
    rp.Chunks(lease_id=4, first_frame=0, count=1),
    rp.PullEnd(lease_id=4),
    rp.LatestQuery(),
    rp.WaitNewer(version=3, timeout_ms=100),
    rp.LatestVersion(version=None),
    rp.StatQuery(),
    rp.ServerStats(
        versions=(1, 2),
        latest=2,
        bytes_held=10,
        clients=1,
        pulls_in_flight=0,
        leases_by_version={2: 1},
        pending_pushes=0,
        malformed_messages=0,
        persisted_version=2,
        state_error=None,
    ),
    SAMPLING,
    rp.GenerateRequest(request_id="r1", prompt_token_ids=(1, 2, 3), sampling=SAMPLING, n=4),
    rp.GenerateRequest(request_id="r2", prompt_token_ids=(1,), sampling=SAMPLING, weight_version=7),
    rp.Sample(token_ids=(1,), logprobs=(-0.5,), finish_reason="stop"),
    rp.ResumedSample(sample_index=3, token_ids=(4, 5)),
    rp.GenerateRequest(
        request_id="r4",
        prompt_token_ids=(1, 2),
        sampling=SAMPLING,
        n=2,
        weight_version=2,
        resume=(
            rp.ResumedSample(sample_index=0, token_ids=(7,)),
            rp.ResumedSample(sample_index=3, token_ids=(8, 9)),
        ),
    ),
    rp.AgentSpec(environment="calculator", record='{"id": "r1"}', max_turns=3, max_total_tokens=64),
    rp.GenerateRequest(
        request_id="r3",
        prompt_token_ids=(1, 2),
        sampling=SAMPLING,
        n=2,
        agent=rp.AgentSpec(environment="calculator", tool_timeout_s=2.0),
    ),
    rp.Sample(
        token_ids=(5, 6, 7, 8),
        logprobs=(-0.1, 0.0, 0.0, -0.3),
        finish_reason="stop",
        model_mask=(1, 0, 0, 1),
        turns=2,
        tool_calls=1,
        end="answer",
        env_reward=0.5,
    ),
    rp.GenerateResult(
        request_id="r1",
        samples=(
            rp.Sample(
                token_ids=(5, 6),
                logprobs=(-0.1, -2.0),
                finish_reason="length",
                top_logprobs=({5: -0.1}, {6: -2.0}),
            ),
        ),
        weight_version=7,
        stats=rp.WorkerStats(generated_tokens=512, active_s=8.5, engine_s=8.0, compile_s=31.0, reloads=2),
    ),
    rp.WorkerStats(),
    rp.Rollout(
        prompt_id="p1",
        group_index=2,
        prompt_token_ids=(1, 2),
        completion_token_ids=(3,),
        worker_logprobs=(-0.5,),
        policy_version=7,
        reward=1.0,
    ),
    rp.Rollout(
        prompt_id="p1",
        group_index=0,
        prompt_token_ids=(1, 2),
        completion_token_ids=(3, 4, 5),
        worker_logprobs=(-0.5, 0.0, -0.2),
        policy_version=7,
        reward=0.0,
        completion_mask=(1, 0, 1),
    ),
    rp.EnvStepRequest(
        request_id="e1",
        environment="calculator",
        record='{"id": "r"}',
        turns=("[1+2]", "3"),
        options='{"format": "bracket"}',
        timeout_s=5.0,
    ),  # fmt: skip
    rp.EnvStepResult(request_id="e1", observation="(3)", done=False, tool_calls=1),
    rp.EnvStepResult(request_id="e2", observation="", done=True, reward=1.0),
    rp.VerifyRequest(request_id="v1", verifier="math", completion="\\boxed{2}", reference="2"),
    rp.VerifyResult(request_id="v1", reward=1.0, correct=True),
    rp.VerifyBatch(request_id="b1", items=3, timeout_s=5.0),
    rp.VerifyBatchResult(request_id="b1", items=3, refused=1),
]


def test_every_message_type_has_an_example() -> None:
    union_types = set(rp.AnyMessage.__args__)
    assert {type(m) for m in EXAMPLES} == union_types


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: rp.Message) -> None:
    data = encode(message)
    assert decode(data) == message
    assert decode_as(memoryview(data), type(message)) == message
    fields = message.__struct_fields__
    if fields:
        with pytest.raises((AttributeError, TypeError)):
            setattr(message, fields[0], None)


def test_wrong_type_is_malformed_and_names_both() -> None:
    with pytest.raises(MalformedMessageError, match="expected PullBegin or LatestQuery, got Ack"):
        decode_as(encode(rp.Ack()), (rp.PullBegin, rp.LatestQuery))


def test_unknown_tag_and_unknown_field_are_malformed() -> None:
    with pytest.raises(MalformedMessageError):
        decode(msgspec.msgpack.encode({"type": "DropTables"}))
    with pytest.raises(MalformedMessageError):
        decode(msgspec.msgpack.encode({"type": "Ack", "extra": 1}))
    with pytest.raises(MalformedMessageError, match="nbytes"):
        decode(
            msgspec.msgpack.encode(
                {
                    "type": "TensorHeader",
                    "name": "a",
                    "dtype": "float32",
                    "shape": [2],
                    "nbytes": 7,
                    "checksum": 0,
                }
            )
        )


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=256))
def test_random_bytes_never_crash(data: bytes) -> None:
    try:
        decode(data)
    except MalformedMessageError:
        pass


@settings(max_examples=300, deadline=None)
@given(message=st.sampled_from(EXAMPLES), cut=st.integers(min_value=1), flip=st.integers(0, 255))
def test_truncated_or_corrupted_encodings(message: rp.Message, cut: int, flip: int) -> None:
    data = bytearray(encode(message))
    truncated = bytes(data[: len(data) - 1 - cut % len(data)])
    with pytest.raises(MalformedMessageError):
        decode(truncated)
    data[cut % len(data)] ^= flip
    try:
        decode(bytes(data))  # may still be valid, e.g. a changed number
    except MalformedMessageError:
        pass


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: rp.SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: rp.SamplingParams(max_tokens=1, temperature=-1.0), "temperature"),
        (lambda: rp.SamplingParams(max_tokens=1, top_p=0.0), "top_p"),
        (lambda: rp.SamplingParams(max_tokens=1, top_k=-2), "top_k"),
        (
            lambda: rp.GenerateRequest(request_id="r", prompt_token_ids=(), sampling=SAMPLING),
            "prompt_token_ids",
        ),
        (lambda: rp.GenerateRequest(request_id="r", prompt_token_ids=(1,), sampling=SAMPLING, n=0), "n"),
        (
            lambda: rp.GenerateRequest(
                request_id="r", prompt_token_ids=(1,), sampling=SAMPLING, weight_version=-1
            ),
            "weight_version",
        ),
        (
            lambda: rp.PushBegin(version=1, manifest=MANIFEST, whole=True, checksums_follow=True),
            "checksums_follow",
        ),
        (lambda: rp.PushCommit(push_id=1, checksums=(1 << 64,)), "checksums"),
        (lambda: rp.PushCommit(push_id=1, checksums=(-1,)), "checksums"),
        (lambda: rp.ResumedSample(sample_index=-1, token_ids=(1,)), "sample_index"),
        (lambda: rp.ResumedSample(sample_index=0, token_ids=()), "token_ids"),
        (
            lambda: rp.GenerateRequest(
                request_id="r", prompt_token_ids=(1,), sampling=SAMPLING, n=2, resume=(RESUMED_0,)
            ),
            "n",
        ),
        (
            lambda: rp.GenerateRequest(
                request_id="r",
                prompt_token_ids=(1,),
                sampling=rp.SamplingParams(max_tokens=4),
                resume=(RESUMED_0,),
            ),
            "resume",
        ),
        (
            lambda: rp.GenerateRequest(
                request_id="r", prompt_token_ids=(1,), sampling=SAMPLING, n=2, resume=(RESUMED_0, RESUMED_0)
            ),
            "resume",
        ),
        (
            lambda: rp.GenerateRequest(
                request_id="r",
                prompt_token_ids=(1,),
                sampling=SAMPLING,
                resume=(RESUMED_0,),
                agent=rp.AgentSpec(environment="calculator"),
            ),
            "resume",
        ),
        (lambda: rp.TensorHeader(name="a//b", dtype="float32", shape=(), nbytes=4, checksum=0), "name"),
        (lambda: rp.TensorHeader(name="a", dtype="complex64", shape=(), nbytes=8, checksum=0), "dtype"),
        (lambda: rp.TensorHeader(name="a", dtype="float32", shape=(-1,), nbytes=0, checksum=0), "shape"),
        (lambda: rp.TensorManifest(protocol_version=1, chunk_bytes=0, tensors=()), "chunk_bytes"),
        (lambda: rp.TensorManifest(protocol_version=1, chunk_bytes=1, tensors=(HEADER, HEADER)), "tensors"),
        (
            lambda: rp.Rollout(
                prompt_id="p",
                group_index=0,
                prompt_token_ids=(1,),
                completion_token_ids=(1, 2),
                worker_logprobs=(0.0,),
                policy_version=0,
            ),
            "worker_logprobs",
        ),
        (
            lambda: rp.Rollout(
                prompt_id="p",
                group_index=0,
                prompt_token_ids=(1,),
                completion_token_ids=(1, 2),
                worker_logprobs=(0.0, 0.0),
                policy_version=0,
                completion_mask=(1,),
            ),
            "completion_mask",
        ),
        (
            lambda: rp.Sample(token_ids=(1, 2), logprobs=(), finish_reason="stop", model_mask=(1, 2)),
            "model_mask",
        ),
        (lambda: rp.Sample(token_ids=(1,), logprobs=(), finish_reason="stop", tool_errors=-1), "tool_errors"),
        (
            lambda: rp.Sample(token_ids=(1,), logprobs=(), finish_reason="stop", env_reward=float("nan")),
            "env_reward",
        ),
        (lambda: rp.AgentSpec(environment=""), "environment"),
        (lambda: rp.EnvStepRequest(request_id="e", environment="", record="{}", turns=("x",)), "environment"),
        (lambda: rp.EnvStepRequest(request_id="e", environment="calculator", record="{}", turns=()), "turns"),
        (
            lambda: rp.EnvStepRequest(
                request_id="e", environment="calculator", record="{}", turns=("x",) * (rp.MAX_ENV_TURNS + 1)
            ),
            "turns",
        ),
        (
            lambda: rp.EnvStepRequest(
                request_id="e", environment="calculator", record="{}", turns=("x",), timeout_s=float("inf")
            ),
            "timeout_s",
        ),
        (lambda: rp.EnvStepResult(request_id="e", observation="", done=True, tool_calls=-1), "tool_calls"),
        (lambda: rp.EnvStepResult(request_id="e", observation="", done=True, reward=float("nan")), "reward"),
        (lambda: rp.AgentSpec(environment="calculator", max_turns=0), "max_turns"),
        (lambda: rp.AgentSpec(environment="calculator", max_total_tokens=0), "max_total_tokens"),
        (lambda: rp.AgentSpec(environment="calculator", tool_timeout_s=float("inf")), "tool_timeout_s"),
    ],
)
def test_validation_names_field(build, field: str) -> None:
    with pytest.raises(ValueError, match=rf"\.{field}="):
        build()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("generated_tokens", -1),
        ("reloads", -3),
        ("active_s", -0.5),
        ("engine_s", float("nan")),
        ("compile_s", float("inf")),
    ],
)
def test_worker_stats_refuse_negative_or_non_finite_totals(field: str, value: float) -> None:
    forged = msgspec.msgpack.encode({"type": "WorkerStats", field: value})  # a hostile worker's totals
    with pytest.raises(MalformedMessageError, match=f"WorkerStats.{field}"):
        decode(forged)


@pytest.mark.parametrize("fields", [{"items": 0}, {"items": -3}, {"items": 2, "timeout_s": float("nan")}])
def test_a_verify_batch_with_impossible_fields_is_malformed(fields):
    # Built by hand (not through the class, which refuses them), as a hostile peer would send it.
    raw = msgspec.msgpack.encode({"type": "VerifyBatch", "request_id": "b", "timeout_s": 1.0, **fields})
    with pytest.raises(rp.MalformedMessageError, match="VerifyBatch"):
        rp.decode(raw)


def test_a_trajectory_that_ended_in_an_environment_error_crosses_the_wire() -> None:
    """The agent loop ends a trajectory `error` when its environment raised or overran; a
    result holding one used to be refused by the controller's decoder."""
    sample = rp.Sample(token_ids=(1, 2), logprobs=(-0.1, -0.2), finish_reason="stop", end="error")
    result = rp.GenerateResult(request_id="r", samples=(sample,), weight_version=0)
    assert rp.decode(rp.encode(result)) == result
