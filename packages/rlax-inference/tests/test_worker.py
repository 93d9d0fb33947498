"""The worker without a run config (`Worker(WorkerConfig, EngineConfig)`, model config from the
pushed weights' metadata) against a real parameter server and the tiny random Llama: exact
greedy tokens and logprobs, the j rule, request validation, unseeded seeds, the bounded
inbox, hostile messages."""

import dataclasses
import threading

import jax
import msgspec
import numpy as np
import pytest
import zmq
from tiny_model import CONFIG, PARAMS, naive_greedy, teacher_forced_logprobs

import rlax_protocol as rp
from rlax_core.testing import wait_until
from rlax_inference.admission import RequestLimits
from rlax_inference.engine import EngineConfig
from rlax_inference.worker_process import Worker, WorkerConfig
from rlax_model import init_params
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol.fuzzing import blast, deep_nesting, hostile_requests

ENGINE = EngineConfig(
    block_size=8,
    num_blocks=96,
    max_num_seqs=32,
    max_num_batched_tokens=512,
    max_model_len=128,
    eos_token_ids=(),
)
PARAMS_V2 = init_params(CONFIG, jax.random.key(5), std=0.25)
PARAMS_V3 = init_params(CONFIG, jax.random.key(6), std=0.25)


def push(address, params, version):
    tree = jax.tree_util.tree_map(np.asarray, params)
    meta = {"model_config": {k: v for k, v in dataclasses.asdict(CONFIG).items()}}
    with ParamClient(address, timeout_s=30) as client:
        client.push(tree, version, metadata=meta)


class RunningWorker:
    def __init__(self, ps_address, engine=ENGINE, **cfg):
        self.worker = Worker(
            WorkerConfig(paramserver=ps_address, weights_poll_s=0.05, rpc_timeout_s=10, **cfg), engine
        )
        self.address = self.worker.start()
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def close(self):
        self.worker.stop()
        self.thread.join(timeout=300)
        assert not self.thread.is_alive()
        assert not self.worker.errors


def greedy_request(rid, prompt, max_tokens=6, n=1, **kw):
    return rp.GenerateRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        n=n,
        sampling=rp.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw),
    )


def roundtrip(client, messages, timeout_s=300):  # bounds a hang: a first compile on loaded cores
    ids = {client.send_request(m): i for i, m in enumerate(messages)}
    replies = [None] * len(messages)
    pending = set(ids)
    while pending:
        rid, reply = client.recv_reply(pending, timeout_s=timeout_s, operation="GenerateResult")
        pending.discard(rid)
        replies[ids[rid]] = reply.message
    return replies


def count_rounds(worker):
    """Counts the worker loop's rounds (each waits up to weights_poll_s for requests, then
    decides about weights): `counter[0]`. Lets a test wait until the worker had its chances
    to do something it must not do, instead of sleeping for a while."""
    counter = [0]
    take_inbox = worker._take_inbox

    def counted(wait_s):
        counter[0] += 1
        take_inbox(wait_s)

    worker._take_inbox = counted
    return counter


@pytest.fixture
def paramserver(tmp_path):
    with running_server(tmp_path / "ps") as address:
        yield address


def test_worker_serves_requests_and_reloads_when_j_behind(paramserver):
    push(paramserver, PARAMS, 1)
    w = RunningWorker(paramserver, reload_staleness=2)
    try:
        with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
            p1, p2 = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]
            r1, bad, r2 = roundtrip(
                client,
                [
                    greedy_request("a", p1, n=2),
                    greedy_request("bad", [5, 4000]),
                    greedy_request("b", p2, top_logprobs=3),
                ],
            )
            assert isinstance(bad, rp.ErrorReply) and bad.code == "malformed"
            assert "'bad'" in bad.message and "4000" in bad.message and "vocabulary" in bad.message
            assert r1.request_id == "a" and r1.weight_version == 1 and len(r1.samples) == 2
            for s in r1.samples:
                assert list(s.token_ids) == naive_greedy(PARAMS, p1, 6) and s.finish_reason == "length"
            np.testing.assert_allclose(
                r2.samples[0].logprobs,
                teacher_forced_logprobs(PARAMS, p2, r2.samples[0].token_ids),
                atol=1e-5,
            )
            assert len(r2.samples[0].top_logprobs) == 6 and len(r2.samples[0].top_logprobs[0]) == 3

            # One version behind (< j=2): the worker keeps its weights.
            push(paramserver, PARAMS_V2, 2)
            checks = w.worker.num_weight_checks
            wait_until(lambda: w.worker.num_weight_checks >= checks + 3)
            (r,) = roundtrip(client, [greedy_request("c", p1)])
            assert r.weight_version == 1
            # Two behind: it reloads the newest version.
            push(paramserver, PARAMS_V3, 3)
            wait_until(lambda: w.worker.reloads == 1)
            (r,) = roundtrip(client, [greedy_request("d", p1)])
            assert r.weight_version == 3 and list(r.samples[0].token_ids) == naive_greedy(PARAMS_V3, p1, 6)
            # The server persists: every weight is its state file, mapped, not a copy.
            assert w.worker.shared_weight_bytes == param_bytes(PARAMS_V3)
            assert r.stats is not None and r.stats.shared_weight_bytes == param_bytes(PARAMS_V3)
    finally:
        w.close()


def param_bytes(params) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(params))


def test_a_worker_told_not_to_map_weights_copies_them_and_generates_the_same(paramserver):
    push(paramserver, PARAMS_V2, 1)
    prompt = [5, 6, 7, 8]
    w = RunningWorker(paramserver, map_weights=False)
    try:
        with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
            (r,) = roundtrip(client, [greedy_request("a", prompt)])
        assert list(r.samples[0].token_ids) == naive_greedy(PARAMS_V2, prompt, 6)
        assert w.worker.shared_weight_bytes == 0
    finally:
        w.close()


def test_worker_answers_unknown_messages_and_keeps_serving(paramserver):
    push(paramserver, PARAMS, 7)
    w = RunningWorker(paramserver)
    try:
        with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
            with pytest.raises(rp.RemoteError, match="unknown_message|not an inference-worker request"):
                client.call(rp.LatestQuery(), retry=False)
            (r,) = roundtrip(client, [greedy_request("x", [3, 4, 5], max_tokens=3)])
            assert r.weight_version == 7 and list(r.samples[0].token_ids) == naive_greedy(
                PARAMS, [3, 4, 5], 3
            )
    finally:
        w.close()


def raw_dealer(address):
    """A DEALER that has said Hello (so its requests get past the handshake)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(address)
    socket.send_multipart(
        [(0).to_bytes(8, "little"), rp.encode(rp.Hello(protocol_version=rp.PROTOCOL_VERSION))]
    )
    assert socket.poll(30_000), "no Welcome"
    assert isinstance(rp.decode(socket.recv_multipart()[1]), rp.Welcome)
    return socket


def test_worker_survives_ten_thousand_hostile_messages_then_answers_a_correct_request(paramserver):
    push(paramserver, PARAMS, 2)
    w = RunningWorker(paramserver)
    try:
        # Deep nesting, huge declared lengths, truncations and wrong framing, with valid
        # requests (generation included) mixed in, all from one client.
        valid = [
            rp.encode(greedy_request("v", [5, 6, 7], max_tokens=1)),
            rp.encode(rp.Hello(protocol_version=rp.PROTOCOL_VERSION)),
        ]
        requests = list(hostile_requests(10_000, seed=11, valid=valid))
        assert any(parts[1:] == [deep_nesting(1000)] for parts in requests)
        replies = 0
        for start in range(0, len(requests), 2_000):  # in parts, to fail fast once the worker died
            replies += blast(w.address, requests[start : start + 2_000], settle_s=1.0)
            assert not w.worker.errors, w.worker.errors
        assert replies > 5_000
        assert w.thread.is_alive() and not w.worker.errors
        # The fuzz client is gone: what it left in flight is cancelled (beyond the bound the
        # worker answered busy), so the next client finds room.
        wait_until(lambda: w.worker.io.num_inflight == 0)
        with rp.RpcClient(w.address, timeout_s=30, client_id="after-fuzz") as client:
            (r,) = roundtrip(client, [greedy_request("ok", [5, 6, 7], max_tokens=4)])
        assert isinstance(r, rp.GenerateResult), r
        assert r.weight_version == 2 and list(r.samples[0].token_ids) == naive_greedy(PARAMS, [5, 6, 7], 4)
    finally:
        w.close()


def test_an_exception_from_one_message_is_answered_and_the_worker_keeps_serving(paramserver, monkeypatch):
    push(paramserver, PARAMS, 3)
    w = RunningWorker(paramserver)
    parse = rp.parse_request

    def parse_or_fail(parts):
        if len(parts) > 2 and parts[2].bytes == b"boom":
            raise RecursionError("maximum recursion depth exceeded while deserializing an object")
        return parse(parts)

    # Whatever the decoder (or a handler) raises on one message, the I/O thread lives on.
    monkeypatch.setattr(rp, "parse_request", parse_or_fail)
    socket = raw_dealer(w.address)
    try:
        socket.send_multipart([(7).to_bytes(8, "little"), b"boom"])
        assert socket.poll(30_000), "the failing message was not answered"
        error = rp.decode(socket.recv_multipart()[1])
        assert (
            isinstance(error, rp.ErrorReply)
            and error.code == "internal"
            and "RecursionError" in error.message
        )
        socket.send_multipart(
            [(8).to_bytes(8, "little"), rp.encode(greedy_request("after", [3, 4], max_tokens=2))]
        )
        assert socket.poll(300_000), "no answer after the failing message"
        result = rp.decode(socket.recv_multipart()[1])
        assert isinstance(result, rp.GenerateResult) and list(result.samples[0].token_ids) == naive_greedy(
            PARAMS, [3, 4], 2
        )
    finally:
        socket.close(0)
        w.close()


def request_with(rid, prompt=(5, 6, 7), n=1, **sampling):
    return rp.GenerateRequest(
        request_id=rid, prompt_token_ids=tuple(prompt), n=n, sampling=rp.SamplingParams(**sampling)
    )


def test_an_out_of_range_field_is_refused_by_name_before_it_takes_blocks(paramserver):
    push(paramserver, PARAMS, 1)
    # The worker's own top_logprobs limit (64) would refuse 1,000 first: the engine's check is tested here.
    w = RunningWorker(paramserver, limits=RequestLimits(max_top_logprobs=2000))
    try:
        with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
            (ok,) = roundtrip(client, [greedy_request("warm", [5, 6, 7], max_tokens=2)])
            assert isinstance(ok, rp.GenerateResult)
            engine = w.worker.engine
            free = engine.num_free_blocks
            # The review's case: 1,000 top logprobs on a 128-token vocabulary (it used to raise
            # inside step() holding 2 blocks and leave an unfinished request forever).
            bad_logprobs, bad_top_k, bad_stop, good = roundtrip(
                client,
                [
                    request_with("lp", max_tokens=4, top_logprobs=1000),
                    request_with("tk", max_tokens=4, top_k=CONFIG.vocab_size + 1),
                    request_with("st", max_tokens=4, stop_token_ids=(3, 4000)),
                    greedy_request("after", [5, 6, 7], max_tokens=4),
                ],
            )
            for reply, rid, field in (
                (bad_logprobs, "lp", "logprobs=1000"),
                (bad_top_k, "tk", f"top_k={CONFIG.vocab_size + 1}"),
                (bad_stop, "st", "stop_token_ids"),
            ):
                assert isinstance(reply, rp.ErrorReply) and reply.code == "malformed", reply
                assert rid in reply.message and field in reply.message, reply.message
            assert isinstance(good, rp.GenerateResult)
            assert list(good.samples[0].token_ids) == naive_greedy(PARAMS, [5, 6, 7], 4)
            wait_until(lambda: not engine.has_unfinished)
            assert engine.num_free_blocks == free
    finally:
        w.close()


def test_requests_without_a_seed_get_distinct_seeds(paramserver):
    push(paramserver, PARAMS, 1)
    w = RunningWorker(paramserver)
    try:
        with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
            # The same request twice (same id, prompt and settings), sampled at temperature 1.
            replies = roundtrip(
                client, [request_with("same", max_tokens=12, temperature=1.0) for _ in range(2)]
            )
            first, second = (tuple(r.samples[0].token_ids) for r in replies)
            assert first != second
            # A seed still fixes the samples.
            seeded = roundtrip(
                client, [request_with("seeded", max_tokens=12, temperature=1.0, seed=3) for _ in range(2)]
            )
            assert seeded[0].samples == seeded[1].samples
    finally:
        w.close()


def test_requests_beyond_the_inflight_bound_are_answered_busy_at_once(paramserver):
    # No weights on the server yet: the engine thread admits nothing, so every request stays
    # in flight and the bound decides alone.
    w = RunningWorker(paramserver, max_inflight_requests=2, max_inflight_per_client=2)
    try:
        with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
            ids = [client.send_request(greedy_request(f"r{i}", [5, 6, 7], max_tokens=3)) for i in range(3)]
            rid, reply = client.recv_reply(set(ids), timeout_s=300, operation="busy")
            assert rid == ids[2]
            assert isinstance(reply.message, rp.ErrorReply) and reply.message.code == "busy"
            assert "r2" in reply.message.message and "max_inflight_requests=2" in reply.message.message
            assert w.worker.version is None  # answered while the engine thread had no weights
            push(paramserver, PARAMS, 1)
            results = {}
            while len(results) < 2:
                rid, reply = client.recv_reply(set(ids[:2]) - set(results), timeout_s=300, operation="result")
                results[rid] = reply.message
            for message in results.values():
                assert isinstance(message, rp.GenerateResult) and message.weight_version == 1
            # Room again once answered.
            (again,) = roundtrip(client, [greedy_request("r3", [5, 6, 7], max_tokens=3)])
            assert isinstance(again, rp.GenerateResult)
    finally:
        w.close()


def pinned(rid, prompt, version, max_tokens=6):
    request = greedy_request(rid, prompt, max_tokens=max_tokens)
    return msgspec.structs.replace(request, weight_version=version)


def test_pinned_requests_are_generated_with_exactly_the_version_they_name(tmp_path):
    """Versions 1..4 held (keep 3: 2, 3, 4): requests naming 3, then 2 (older than the
    newest and than the loaded one), then 4 get the greedy tokens of exactly those weights;
    version 1 is gone: refused by name, the worker keeps serving; a worker that does not
    follow the newest never reloads on its own."""
    weights = {1: PARAMS, 2: PARAMS_V2, 3: PARAMS_V3, 4: init_params(CONFIG, jax.random.key(7), std=0.25)}
    prompt = [5, 6, 7, 8]
    with running_server(tmp_path / "ps", keep=3) as address:
        for version, params in weights.items():
            push(address, params, version)
        w = RunningWorker(address, follow_latest=False)
        try:
            with rp.RpcClient(w.address, timeout_s=30, client_id="test") as client:
                r3, r2, gone, r4 = roundtrip(
                    client,
                    [
                        pinned("v3", prompt, 3),
                        pinned("v2", prompt, 2),
                        pinned("v1", prompt, 1),
                        pinned("v4", prompt, 4),
                    ],
                )
                for result, version in ((r3, 3), (r2, 2), (r4, 4)):
                    assert isinstance(result, rp.GenerateResult), result
                    assert result.weight_version == version
                    assert list(result.samples[0].token_ids) == naive_greedy(weights[version], prompt, 6)
                assert isinstance(gone, rp.ErrorReply) and gone.code == "not_found", gone
                assert "'v1'" not in gone.message and "v1" in gone.message and "version 1" in gone.message
                # The greedy tokens of the four weight sets differ, so the check above has teeth.
                assert len({tuple(naive_greedy(p, prompt, 6)) for p in weights.values()}) > 1
                reloads = w.worker.reloads
                rounds = count_rounds(w.worker)
                wait_until(lambda: rounds[0] >= 10)  # nine whole rounds: no reload to the newest
                (again,) = roundtrip(client, [pinned("v2b", prompt, 2)])
                assert again.weight_version == 2 and w.worker.reloads == reloads + 1
        finally:
            w.close()
