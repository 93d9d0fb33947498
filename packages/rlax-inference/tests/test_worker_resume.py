"""Partial rollouts resumed by a worker (`GenerateRequest.resume`): a sample continued after its
first tokens draws the keys the uninterrupted sample would have drawn, so on the same weights
it ends as the uninterrupted one; on newer weights its new tokens are the newer version's."""

import dataclasses

import msgspec
import numpy as np
import pytest
from test_worker import ENGINE, PARAMS_V2, RunningWorker, push, roundtrip
from tiny_model import PARAMS, teacher_forced_logprobs

import rlax_protocol as rp
from rlax_paramserver.testing import running_server

PROMPT = (5, 6, 7, 8)
FIRST = 5  # tokens of the first segment


def sampled(rid, max_tokens, n=4, version=None, resume=()):
    return rp.GenerateRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        n=n,
        weight_version=version,
        sampling=rp.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1234),
        resume=resume,
    )


def resumed_from(first: rp.GenerateResult, indices) -> tuple[rp.ResumedSample, ...]:
    return tuple(rp.ResumedSample(sample_index=i, token_ids=first.samples[i].token_ids) for i in indices)


@pytest.fixture
def worker(tmp_path):
    with running_server(tmp_path / "ps") as address:
        push(address, PARAMS, 1)
        push(address, PARAMS_V2, 2)
        w = RunningWorker(address, follow_latest=False)
        try:
            yield w
        finally:
            w.close()


def test_a_resumed_sample_on_the_same_weights_ends_as_the_uninterrupted_one(worker):
    with rp.RpcClient(worker.address, timeout_s=30, client_id="test") as client:
        whole, first = roundtrip(
            client, [sampled("whole", 14, version=1), sampled("first", FIRST, version=1)]
        )
        # Samples 3 and 1, out of order: the answer follows the request's order.
        (rest,) = roundtrip(
            client,
            [sampled("rest", 14 - FIRST, n=2, version=1, resume=resumed_from(first, (3, 1)))],
        )
    assert isinstance(rest, rp.GenerateResult), rest
    assert rest.weight_version == 1
    for position, index in enumerate((3, 1)):
        head, tail, full = first.samples[index], rest.samples[position], whole.samples[index]
        assert len(head.token_ids) == FIRST
        assert head.token_ids + tail.token_ids == full.token_ids
        np.testing.assert_allclose(head.logprobs + tail.logprobs, full.logprobs, atol=1e-4)
    # The four samples differ from each other, so the order check above has teeth.
    assert len({s.token_ids for s in whole.samples}) == 4


def test_a_resumed_sample_on_newer_weights_continues_with_them(worker):
    with rp.RpcClient(worker.address, timeout_s=30, client_id="test") as client:
        (first,) = roundtrip(client, [sampled("first", FIRST, version=1)])
        old, new = roundtrip(
            client,
            [
                sampled("old", 9, n=4, version=1, resume=resumed_from(first, range(4))),
                sampled("new", 9, n=4, version=2, resume=resumed_from(first, range(4))),
            ],
        )
    assert (old.weight_version, new.weight_version) == (1, 2)
    assert [s.token_ids for s in old.samples] != [s.token_ids for s in new.samples]
    for i, sample in enumerate(new.samples):
        context = PROMPT + first.samples[i].token_ids
        expected = teacher_forced_logprobs(PARAMS_V2, context, sample.token_ids)
        np.testing.assert_allclose(sample.logprobs, expected, atol=1e-4)
        # and they are not version 1's probabilities of the same tokens
        assert not np.allclose(
            sample.logprobs, teacher_forced_logprobs(PARAMS, context, sample.token_ids), atol=1e-3
        )


def test_with_kept_kv_a_sample_resumed_on_newer_weights_continues_from_the_old_kv(tmp_path):
    """`workers.resume_kv: keep`: the worker that ran a sample's first segment continues it
    on the newer weights from the K/V the older ones computed (no prefill of its tokens so
    far), so its new tokens' log-probs are not the newer weights' alone."""
    with running_server(tmp_path / "ps") as address:
        push(address, PARAMS, 1)
        push(address, PARAMS_V2, 2)
        w = RunningWorker(
            address, engine=dataclasses.replace(ENGINE, keep_stale_kv=True), follow_latest=False
        )
        try:
            with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
                (first,) = roundtrip(client, [sampled("first", FIRST, version=1)])
                assert w.worker.engine is not None
                hits_before = w.worker.engine.num_prefix_cache_hit_tokens
                (new,) = roundtrip(
                    client, [sampled("new", 9, n=4, version=2, resume=resumed_from(first, range(4)))]
                )
                hits = w.worker.engine.num_prefix_cache_hit_tokens - hits_before
        finally:
            w.close()
    assert new.weight_version == 2
    # Each sample's tokens so far but the last came from the cache (4 prompt + 5 generated - 1).
    assert hits == 4 * (len(PROMPT) + FIRST - 1)
    for i, sample in enumerate(new.samples):
        context = PROMPT + first.samples[i].token_ids
        recomputed = teacher_forced_logprobs(PARAMS_V2, context, sample.token_ids)
        assert not np.allclose(sample.logprobs, recomputed, atol=1e-3)


def test_a_resumed_prompt_beyond_the_context_is_refused_by_name_and_the_worker_keeps_serving(worker):
    limit = worker.worker.engine_config.max_model_len
    long_tail = rp.ResumedSample(sample_index=0, token_ids=(3,) * (limit - len(PROMPT)))
    with rp.RpcClient(worker.address, timeout_s=30, client_id="test") as client:
        refused, ok = roundtrip(
            client, [sampled("long", 4, n=1, version=1, resume=(long_tail,)), sampled("ok", 3, version=1)]
        )
    assert isinstance(refused, rp.ErrorReply) and refused.code == "too_large", refused
    assert "longest resumed sample" in refused.message and "long" in refused.message
    assert isinstance(ok, rp.GenerateResult) and len(ok.samples) == 4


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"n": 3}, "number of resumed samples"),
        ({"sampling": rp.SamplingParams(max_tokens=4)}, "needs sampling.seed"),
        ({"agent": rp.AgentSpec(environment="calculator")}, "multi-turn"),
        (
            {"resume": (rp.ResumedSample(sample_index=1, token_ids=(4,)),) * 2},
            "sample_index twice",
        ),
    ],
)
def test_a_malformed_resume_is_refused_by_field(change, words):
    base = sampled(
        "r", 4, n=2, resume=tuple(rp.ResumedSample(sample_index=i, token_ids=(4,)) for i in range(2))
    )
    fields = {f: getattr(base, f) for f in base.__struct_fields__} | change
    with pytest.raises(ValueError, match=words):
        rp.GenerateRequest(**fields)
    wire = msgspec.msgpack.encode(msgspec.structs.replace(base, n=2))
    assert msgspec.msgpack.decode(wire, type=rp.GenerateRequest) == base
    for bad in ({"sample_index": -1, "token_ids": (4,)}, {"sample_index": 0, "token_ids": ()}):
        with pytest.raises(ValueError, match="ResumedSample"):
            rp.ResumedSample(**bad)
