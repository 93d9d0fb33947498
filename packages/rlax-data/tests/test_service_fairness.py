"""`rlax-verifier` as a separate process: one client's slow request (sandboxed programs that
sleep, a long math batch) does not hold up another client's exact match, and what a client
asks for is bounded by the service, not the client (issue 29)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import msgspec
import pytest
import zmq

import rlax_protocol as rp
from rlax_data import CodeTests, Record
from rlax_data.verifier_process import encode_batch
from rlax_protocol.transport import pack_request_id, unpack_request_id

MAX_S = 3.0
"""The code route's sandbox timeout: the most any client's job may run."""


@pytest.fixture
def verifier(start_verifier) -> Iterator[str]:
    service = start_verifier(sandbox={"workers": 2, "timeout_s": MAX_S})
    yield service.address
    assert service.alive(), "the service died"


def _sleeper(n: int, **tests: float) -> tuple[str, Record]:
    record = Record(id=f"sleep{n}", prompt="p", task="code", tests=CodeTests(script="pass", **tests))
    return "import time\ntime.sleep(60)\n", record


def _outcome(reply: rp.transport.Reply) -> dict:
    assert isinstance(reply.message, rp.VerifyBatchResult), reply.message
    return msgspec.json.decode(reply.frames[0].bytes)


def _exact_match(client: rp.RpcClient) -> rp.Message:
    """Client B's request, answered."""
    reply = client.call(
        rp.VerifyRequest(request_id="b", verifier="exact_match", completion="42", reference="42"),
        retry=False,
    )
    return reply.message


def _not_answered_yet(client: rp.RpcClient, rid: int) -> bool:
    """Whether `rid`'s reply has not arrived at `client` (looked for, not waited for)."""
    try:
        client.recv_reply({rid}, timeout_s=0.05, operation="A's batch, not yet")
    except rp.ProtocolTimeoutError:
        return True
    return False


def _taken_in(client: rp.RpcClient) -> None:
    """Return once the service has taken in every request `client` sent before: a request
    for an unknown verifier is refused at admission, in the order the socket delivered it,
    so its refusal comes after what went before it was admitted (an event, not a sleep)."""
    probe = rp.VerifyRequest(request_id="probe", verifier="no_such_verifier", completion="x")
    _, reply = client.recv_reply({client.send_request(probe)}, timeout_s=60, operation="the probe's refusal")
    assert isinstance(reply.message, rp.ErrorReply) and reply.message.code == "not_found", reply.message


def _warm_up(client: rp.RpcClient) -> None:
    """One quick program first: the sandbox checks itself on its first use."""
    quick = Record(id="quick", prompt="p", task="code", tests=CodeTests(script="pass"))
    rid = client.send_request(rp.VerifyBatch(request_id="w", items=1), [encode_batch([("x = 1\n", quick)])])
    _, reply = client.recv_reply({rid}, timeout_s=60, operation="warm-up")
    assert _outcome(reply)["results"][0]["correct"] is True


def test_sleeping_programs_do_not_delay_another_clients_exact_match(verifier):
    with (
        rp.RpcClient(verifier, timeout_s=60, retries=0) as a,
        rp.RpcClient(verifier, timeout_s=60, retries=0) as b,
    ):
        _warm_up(a)
        b.connect()
        header = rp.VerifyBatch(request_id="a", items=2, timeout_s=MAX_S)  # the server's maximum
        rid = a.send_request(header, [encode_batch([_sleeper(0), _sleeper(1)])])
        _taken_in(a)  # A's programs are admitted
        answer_b = _exact_match(b)
        # The order of events, not a time bound: B's answer came while A's programs still
        # ran (they run MAX_S; a server that served in arrival order answers A first).
        a_still_running = _not_answered_yet(a, rid)
        _, reply_a = a.recv_reply({rid}, timeout_s=60, operation="A's batch")
    assert isinstance(answer_b, rp.VerifyResult) and answer_b.correct
    assert a_still_running, "client B was answered only after client A's programs"
    results = _outcome(reply_a)["results"]
    assert [r["correct"] for r in results] == [False, False]
    assert all(f"timed out after {MAX_S:g}s" in json.dumps(r["details"]) for r in results)


def test_a_long_math_batch_does_not_delay_another_clients_exact_match(verifier):
    # 3.7 ms a math item on a quiet 2-core machine (15-25 ms under the suite's load): this
    # batch holds seconds of the main thread's work, far longer than an exact match takes.
    n = 600
    items = [
        (f"so \\boxed{{{i}/7}}", Record(id=f"m{i}", prompt="p", answer=f"\\frac{{{i}}}{{7}}", task="math"))
        for i in range(n)
    ]
    with (
        rp.RpcClient(verifier, timeout_s=120, retries=0) as a,
        rp.RpcClient(verifier, timeout_s=60, retries=0) as b,
    ):
        a.connect()
        b.connect()
        rid = a.send_request(rp.VerifyBatch(request_id="a", items=n), [encode_batch(items)])
        _taken_in(a)  # A's batch is admitted
        answer_b = _exact_match(b)
        a_still_running = _not_answered_yet(a, rid)  # as above: B came first
        _, reply_a = a.recv_reply({rid}, timeout_s=120, operation="A's batch")
    assert isinstance(answer_b, rp.VerifyResult) and answer_b.correct
    assert a_still_running, "client B was answered only after client A's math"
    assert all(r["correct"] for r in _outcome(reply_a)["results"])


def test_a_timeout_above_the_servers_maximum_is_clamped_to_it(verifier):
    # The batch asks 1e9 s and its record 1e6 s: each job still ends at the code route's
    # sandbox timeout, and the answer says so.
    with rp.RpcClient(verifier, timeout_s=60, retries=0) as client:
        _warm_up(client)
        header = rp.VerifyBatch(request_id="long", items=2, timeout_s=1e9)
        frame = encode_batch([_sleeper(0), _sleeper(1, timeout_s=1e6)])
        rid = client.send_request(header, [frame])
        # The programs sleep 60 s: unclamped, no answer would come within this wait.
        _, reply = client.recv_reply({rid}, timeout_s=45, operation="a batch asking 1e9 s")
        results = _outcome(reply)["results"]
        assert [r["correct"] for r in results] == [False, False]
        assert all(f"timed out after {MAX_S:g}s" in json.dumps(r["details"]) for r in results)


def test_a_timeout_that_is_not_a_positive_number_is_refused_naming_it(verifier):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(verifier)
    try:
        hello = rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id="t")
        sock.send_multipart([pack_request_id(0), rp.encode(hello)])
        assert isinstance(_raw_reply(sock)[1], rp.Welcome)
        good = rp.encode(
            rp.VerifyRequest(request_id="x", verifier="exact_match", completion="1", timeout_s=1.5)
        )
        assert good.count(struct.pack(">d", 1.5)) == 1
        for n, bad in enumerate((float("nan"), float("inf"), -1.0, 0.0), start=1):
            # A client that skips the message's own checks: the service refuses it.
            sock.send_multipart(
                [pack_request_id(n), good.replace(struct.pack(">d", 1.5), struct.pack(">d", bad))]
            )
            rid, reply = _raw_reply(sock)
            assert rid == n and isinstance(reply, rp.ErrorReply) and reply.code == "malformed", reply
            assert "timeout_s" in reply.message, reply
        sock.send_multipart([pack_request_id(9), good])  # and still serves
        assert isinstance(_raw_reply(sock)[1], rp.VerifyResult)
    finally:
        sock.close(0)


def _raw_reply(sock: zmq.Socket) -> tuple[int, rp.Message]:
    parts = rp.recv_within(sock, timeout_s=30, peer="verifier", operation="reply")
    return unpack_request_id(parts[0]), rp.decode(parts[1].buffer)
