"""`rlax-verifier` on loopback: batches served, malformed requests answered, still serving."""

from __future__ import annotations

import signal
import threading
from collections import Counter

import msgspec
import pytest
import zmq

import rlax_protocol as rp
from rlax_data import CallCase, CodeTests, Record
from rlax_data.tasks import TASK_NAMES, ArithmeticTask, CountdownTask, make_task
from rlax_data.verifier_process import RemoteVerifier, VerifierService, default_routes
from rlax_data.verify import build_verifier
from rlax_data.verify.base import VerifyResult
from rlax_data.verify.countdown import CountdownVerifier
from rlax_data.verify.registry import RoutingVerifier
from rlax_protocol.transport import pack_request_id


@pytest.fixture
def service(start_verifier):
    return start_verifier(sandbox={"workers": 2, "timeout_s": 5})


def _mixed_batch() -> list[tuple[str, Record]]:
    arith = ArithmeticTask().generate(3, seed=0)
    cd = CountdownTask().generate(2, seed=0)
    code = Record(
        id="sq",
        prompt="square",
        task="code",
        tests=CodeTests(
            entry_point="sq", calls=[CallCase(args=[3], expected=9), CallCase(args=[-2], expected=4)]
        ),
    )
    math = Record(id="m", prompt="half?", answer="\\frac{1}{2}", task="math")
    return [
        (arith[0].answer, arith[0]),
        ("0", arith[1]),
        (cd[0].answer, cd[0]),
        ("1+1", cd[1]),
        ("def sq(x):\n    return x * x\n", code),
        ("def sq(x):\n    return x * x if x > 0 else x\n", code),
        ("so \\boxed{0.5}", math),
        (arith[2].answer, arith[2]),
    ]


def test_remote_verifier_matches_local(service):
    address = service.address
    items = _mixed_batch()
    remote = RemoteVerifier(address, timeout_s=60)
    try:
        got = remote.verify(items)
    finally:
        remote.close()
    want = build_verifier(default_routes()).verify(items)
    assert [r.correct for r in got] == [True, False, True, False, True, False, True, True]
    assert [(r.reward, r.correct) for r in got] == [(r.reward, r.correct) for r in want]
    assert got[5].details["passed"] == 1


def _raw_call(sock: zmq.Socket, parts: list[bytes], rid: int = 0) -> rp.Message:
    rp.send_within(sock, parts, timeout_s=5, peer="svc", operation="raw")
    frames = rp.recv_within(sock, timeout_s=30, peer="svc", operation="raw")
    return rp.decode(frames[1].buffer)


def test_malformed_requests_get_errors_and_service_keeps_serving(service):
    address, proc = service.address, service.process
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    try:
        pid = pack_request_id
        good = rp.VerifyRequest(request_id="g", verifier="arithmetic", completion="19", reference="19")
        # before Hello
        r = _raw_call(sock, [pid(1), rp.encode(good)])
        assert isinstance(r, rp.ErrorReply) and r.code == "handshake_required"
        hello = rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id="t", role="test")
        assert isinstance(_raw_call(sock, [pid(2), rp.encode(hello)]), rp.Welcome)
        cases = [
            ([pid(3), b"\xc1garbage"], "malformed"),
            ([b"short", rp.encode(good)], "malformed"),
            ([pid(4)], "malformed"),
            ([pid(5), rp.encode(rp.LatestQuery())], "unknown_message"),
            (
                [pid(6), rp.encode(rp.VerifyRequest(request_id="x", verifier="nope", completion="1"))],
                "not_found",
            ),
            (
                [
                    pid(7),
                    rp.encode(
                        rp.VerifyRequest(
                            request_id="x", verifier="code", completion="1", extra={"record": "{"}
                        )
                    ),
                ],
                "malformed",
            ),
            (
                [pid(8), rp.encode(rp.VerifyRequest(request_id="x", verifier="countdown", completion="1+2"))],
                "bad_request",
            ),
        ]
        for parts, code in cases:
            reply = _raw_call(sock, parts)
            assert isinstance(reply, rp.ErrorReply) and reply.code == code, (parts, reply)
            ok = _raw_call(sock, [pid(9), rp.encode(good)])
            assert isinstance(ok, rp.VerifyResult) and ok.correct and ok.request_id == "g"
        # The request's timeout caps the sandbox: a sleeping program is cut at 1 s.
        slow = Record(id="slow", prompt="p", tests=CodeTests(script="pass"))
        req = rp.VerifyRequest(
            request_id="s",
            verifier="code",
            completion="import time\ntime.sleep(30)\n",
            extra={"record": msgspec.json.encode(slow).decode()},
            timeout_s=1.0,
        )
        res = _raw_call(sock, [pid(10), rp.encode(req)])
        assert isinstance(res, rp.VerifyResult) and not res.correct
        assert "timed out after 1s" in res.detail
        assert proc.poll() is None
    finally:
        sock.close(linger=0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


def test_in_process_service_scores_a_batch_message_in_one_call():
    verifier = build_verifier(default_routes())
    svc = VerifierService(verifier, address="tcp://127.0.0.1:*", poll_s=0.05)
    thread = threading.Thread(target=svc.serve)
    recs = ArithmeticTask().generate(40, seed=2)
    thread.start()
    try:
        client = rp.RpcClient(svc.bound_address, timeout_s=10)
        remote = RemoteVerifier(client=client, timeout_s=30)
        res = remote.verify([(r.answer, r) for r in recs])
        assert all(r.correct for r in res)
        assert svc.stats["items"] == 40 and svc.stats["requests"] == 1  # one message held them all
        remote.close()
    finally:
        svc.stop()
        thread.join(timeout=10)
        svc.close()
    assert not thread.is_alive()


class ProgramRunner:
    """Stands in for the code verifier and counts how often each program runs.

    Like `CodeVerifier`, it checks every record of a batch (a record without tests is
    refused) before it runs anything.
    """

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.batches: list[int] = []

    def verify(self, items):
        for _, record in items:
            if record.tests is None:
                raise ValueError(f"record {record.id!r}: field `tests` is required by the code verifier")
        self.batches.append(len(items))
        self.runs.update(record.id for _, record in items)
        return [VerifyResult(reward=1.0, correct=True, details={"ran": record.id}) for _, record in items]


def _score_one_batch(routes: dict, requests: list[rp.VerifyRequest]) -> dict[str, rp.Message]:
    """Send `requests` pipelined to an in-process service that takes them as one batch;
    returns each request's reply by its `request_id`."""
    svc = VerifierService(
        RoutingVerifier(routes),
        address="tcp://127.0.0.1:*",
        max_batch=len(requests),
        batch_window_s=0.0,
        poll_s=0.05,
    )
    thread = threading.Thread(target=svc.serve)
    thread.start()
    client = rp.RpcClient(svc.bound_address, timeout_s=10)
    try:
        client.connect()  # the Hello, answered at once
        # The window is read after a batch's first message arrives, so the requests
        # below are collected together (the batch is full once all have arrived).
        svc.server.batch_window_s = 10.0
        sent = {client.send_request(req): req.request_id for req in requests}
        replies = {}
        pending = set(sent)
        while pending:
            rid, reply = client.recv_reply(pending, timeout_s=10, operation="VerifyRequest")
            pending.discard(rid)
            replies[sent[rid]] = reply.message
    finally:
        client.close()
        svc.stop()
        thread.join(timeout=10)
        svc.close()
    assert svc.stats["batches"] == 1  # the test is about one batch
    return replies


def _code_request(rid: str, *, with_tests: bool = True) -> rp.VerifyRequest:
    tests = CodeTests(entry_point="f", calls=[CallCase(args=[1], expected=1)]) if with_tests else None
    record = Record(id=rid, prompt="p", answer=None if with_tests else "1", tests=tests)
    return rp.VerifyRequest(
        request_id=rid,
        verifier="code",
        completion="def f(x): return x",
        extra={"record": msgspec.json.encode(record).decode()},
    )


def test_a_bad_record_of_another_route_does_not_make_programs_run_again():
    runner = ProgramRunner()
    good = [_code_request(f"c{i}") for i in range(8)]
    # A Countdown record without its numbers and target: its verifier refuses it.
    bad = rp.VerifyRequest(request_id="cd", verifier="countdown", completion="1+2", reference="3")
    replies = _score_one_batch({"code": runner, "countdown": CountdownVerifier()}, good + [bad])
    assert isinstance(replies["cd"], rp.ErrorReply) and replies["cd"].code == "bad_request"
    assert "numbers" in replies["cd"].message
    assert all(
        isinstance(replies[r.request_id], rp.VerifyResult) and replies[r.request_id].correct for r in good
    )
    assert runner.runs == {r.request_id: 1 for r in good}  # every program ran once


def test_a_bad_record_fails_alone_and_the_rest_stay_batched():
    runner = ProgramRunner()
    requests = [_code_request(f"c{i}", with_tests=i != 5) for i in range(16)]
    replies = _score_one_batch({"code": runner}, requests)
    assert isinstance(replies["c5"], rp.ErrorReply) and "'c5'" in replies["c5"].message
    good = [r.request_id for r in requests if r.request_id != "c5"]
    assert all(isinstance(replies[rid], rp.VerifyResult) for rid in good)
    assert runner.runs == {rid: 1 for rid in good}
    # Halving around the bad record leaves at most log2(16) + 1 batches, not 15 of one.
    assert len(runner.batches) <= 5 and max(runner.batches) >= 8, runner.batches


@pytest.mark.parametrize("name", TASK_NAMES)
def test_every_built_in_task_is_served_as_its_own_verifier_scores_it(name):
    # A run with `verifier.mode: service` routes each record by its task name: a built-in task
    # without a route looped forever on 'not_found' (tool_arithmetic did).
    task = make_task(name)
    records = task.generate(6, seed=3)
    completions = [r.answer for r in records[:3]] + ["0" + (r.answer or "") + "x" for r in records[3:]]
    items = list(zip(completions, records, strict=True))
    served = build_verifier(default_routes()).verify(items)
    own = task.verifier().verify(items)
    assert [(r.reward, r.correct) for r in served] == [(r.reward, r.correct) for r in own]
    assert [r.correct for r in served] == [True] * 3 + [False] * 3
