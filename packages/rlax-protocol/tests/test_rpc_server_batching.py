"""`RpcServer` with a batch handler: what is waiting is handled in one call, every
request gets its own answer, and no request (malformed, oversize, poisonous, or from a
client that went away) costs another its answer or stops the server."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import zmq

import rlax_protocol as rp
from rlax_protocol import RemoteError, RpcClient
from rlax_protocol.transport import pack_request_id


class Scorer:
    """A batch handler that records each call's size. A `VerifyRequest` is right when
    completion == reference; completion ``poison`` makes any batch holding it raise,
    ``refuse`` is answered with that request's own error, ``block`` waits for `release`."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.threads: list[threading.Thread] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, batch: list[tuple[rp.Message, list[zmq.Frame]]]) -> list[rp.rpc_server.BatchResult]:
        self.calls.append(len(batch))
        self.threads.append(threading.current_thread())
        out: list[rp.rpc_server.BatchResult] = []
        for message, frames in batch:
            if isinstance(message, rp.LatestQuery):
                out.append((rp.LatestVersion(version=len(frames)), frames))
                continue
            assert isinstance(message, rp.VerifyRequest)
            if message.completion == "poison":
                raise ValueError("poisoned batch")
            if message.completion == "block":
                self.entered.set()
                assert self.release.wait(10)
            if message.completion == "refuse":
                out.append(RemoteError("bad_request", f"refused {message.request_id}"))
                continue
            ok = message.completion == message.reference
            out.append(rp.VerifyResult(request_id=message.request_id, reward=float(ok), correct=ok))
        return out


@contextmanager
def serving(scorer: Scorer, **kwargs: object) -> Iterator[rp.RpcServer]:
    server = rp.RpcServer("tcp://127.0.0.1:*", batch_handler=scorer, server_id="batcher", **kwargs)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def dealer(address: str) -> Iterator[zmq.Socket[bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(0)


def hello(rid: int = 0) -> list[bytes]:
    return [pack_request_id(rid), rp.encode(rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id="t"))]


def verify(rid: int, completion: str, reference: str = "ok") -> list[bytes]:
    req = rp.VerifyRequest(request_id=f"r{rid}", verifier="v", completion=completion, reference=reference)
    return [pack_request_id(rid), rp.encode(req)]


def replies(sock: zmq.Socket[bytes], n: int) -> dict[int, rp.Message]:
    """The next `n` replies on `sock`, by request id (each id must come once)."""
    out: dict[int, rp.Message] = {}
    for _ in range(n):
        parts = rp.recv_within(sock, timeout_s=10, peer="server", operation="reply")
        rid = rp.transport.unpack_request_id(parts[0])
        assert rid not in out, f"request {rid} answered twice"
        out[rid] = rp.decode(parts[1].buffer)
    return out


def send_all(sock: zmq.Socket[bytes], requests: Sequence[list[bytes]]) -> None:
    for parts in requests:
        sock.send_multipart(parts)


def assert_served_afterwards(server: rp.RpcServer) -> None:
    server.batch_window_s = 0.0  # a lone client's Hello must not wait for company
    with RpcClient(server.address, timeout_s=5, retries=0) as client:
        got = client.call(rp.VerifyRequest(request_id="after", verifier="v", completion="ok", reference="ok"))
        assert got.message == rp.VerifyResult(request_id="after", reward=1.0, correct=True)


def test_requests_waiting_together_are_handled_in_one_call_and_each_answered() -> None:
    scorer = Scorer()
    # The window holds the drain open until max_batch messages (Hello + 5) have come.
    with serving(scorer, max_batch=6, batch_window_s=10.0) as server, dealer(server.address) as sock:
        send_all(sock, [hello(), *(verify(i, "ok" if i % 2 else "no") for i in range(1, 6))])
        got = replies(sock, 6)
        assert isinstance(got[0], rp.Welcome)
        for i in range(1, 6):
            assert got[i] == rp.VerifyResult(request_id=f"r{i}", reward=float(i % 2), correct=bool(i % 2))
        assert scorer.calls == [5]


def test_one_malformed_request_gets_its_own_error_and_the_others_their_answers() -> None:
    scorer = Scorer()
    batch = [
        hello(),
        verify(1, "ok"),
        [pack_request_id(2), b"\xc1 not msgpack"],
        verify(3, "no"),
        [pack_request_id(4), b"\x91" * 5000 + b"\xc0"],  # nesting deeper than any message
        verify(5, "refuse"),
        [pack_request_id(6), rp.encode(rp.VerifyRequest(request_id="x", verifier=1, completion=2))],  # type: ignore[arg-type]
        verify(7, "ok"),
    ]
    with serving(scorer, max_batch=len(batch), batch_window_s=10.0) as server, dealer(server.address) as sock:
        send_all(sock, batch)
        got = replies(sock, len(batch))
        assert got[1] == rp.VerifyResult(request_id="r1", reward=1.0, correct=True)
        assert got[3] == rp.VerifyResult(request_id="r3", reward=0.0, correct=False)
        assert got[7] == rp.VerifyResult(request_id="r7", reward=1.0, correct=True)
        for rid in (2, 4, 6):
            assert isinstance(got[rid], rp.ErrorReply) and got[rid].code == "malformed", got[rid]
        assert got[5] == rp.ErrorReply(code="bad_request", message="refused r5")
        assert scorer.calls == [4]  # the three well-formed requests and the refused one, together
        assert_served_afterwards(server)


def test_a_request_that_makes_the_batch_raise_fails_alone() -> None:
    scorer = Scorer()
    batch = [hello(), verify(1, "ok"), verify(2, "poison"), verify(3, "no"), verify(4, "ok")]
    with serving(scorer, max_batch=len(batch), batch_window_s=10.0) as server, dealer(server.address) as sock:
        send_all(sock, batch)
        got = replies(sock, len(batch))
        assert isinstance(got[2], rp.ErrorReply) and got[2].code == "internal"
        assert "poisoned batch" in got[2].message
        assert [got[i].correct for i in (1, 3, 4)] == [True, False, True]  # type: ignore[union-attr]
        assert scorer.calls == [4, 1, 1, 1, 1]  # the batch, then each request alone


def test_a_batch_handler_returning_the_wrong_number_of_results_is_retried_per_request() -> None:
    calls: list[int] = []

    def short(batch: list[tuple[rp.Message, list[zmq.Frame]]]) -> list[rp.rpc_server.BatchResult]:
        calls.append(len(batch))
        return [rp.Ack()] * min(len(batch), 1)

    with (
        rp.RpcServer("tcp://127.0.0.1:*", batch_handler=short, max_batch=4, batch_window_s=10.0) as server,
        dealer(server.address) as sock,
    ):
        send_all(sock, [hello(), verify(1, "a"), verify(2, "b"), verify(3, "c")])
        got = replies(sock, 4)
        assert [got[i] for i in (1, 2, 3)] == [rp.Ack()] * 3
        assert calls == [3, 1, 1, 1]


def test_max_batch_bounds_what_one_call_gets() -> None:
    scorer = Scorer()
    with serving(scorer, max_batch=4, batch_window_s=0.5) as server, dealer(server.address) as sock:
        send_all(sock, [hello(), *(verify(i, "ok") for i in range(1, 10))])
        got = replies(sock, 10)
        assert all(isinstance(got[i], rp.VerifyResult) for i in range(1, 10))
        assert sum(scorer.calls) == 9 and max(scorer.calls) <= 4, scorer.calls


def test_oversize_requests_are_refused_and_the_server_keeps_serving() -> None:
    scorer = Scorer()
    with serving(scorer, max_request_bytes=4096) as server, dealer(server.address) as sock:
        send_all(sock, [hello()])
        replies(sock, 1)
        query = rp.encode(rp.LatestQuery())
        big_message = rp.encode(rp.VerifyRequest(request_id="b", verifier="v", completion="x" * 5000))
        send_all(
            sock,
            [
                [pack_request_id(1), query, b"x" * 5000],  # one big raw frame
                [pack_request_id(2), query, *([b"x" * 1000] * 5)],  # frames that add up
                [pack_request_id(3), big_message],  # a big message part
                [pack_request_id(4), query, b"x" * 1000],  # within the limit
            ],
        )
        got = replies(sock, 4)
        for rid in (1, 2, 3):
            assert isinstance(got[rid], rp.ErrorReply) and got[rid].code == "too_large", got[rid]
        assert got[4] == rp.LatestVersion(version=1)
        assert_served_afterwards(server)


def test_replies_go_to_the_right_client_when_two_clients_interleave() -> None:
    scorer = Scorer()
    with (
        serving(scorer, max_batch=10, batch_window_s=10.0) as server,
        dealer(server.address) as a,
        dealer(server.address) as b,
    ):
        a.send_multipart(hello())
        b.send_multipart(hello())
        for i in range(1, 5):  # the same request ids from both; only one client's answers are right
            a.send_multipart(verify(i, f"a{i}", reference=f"a{i}"))
            b.send_multipart(verify(i, f"b{i}", reference=f"a{i}"))
        got_a, got_b = replies(a, 5), replies(b, 5)
        assert scorer.calls == [8]  # both clients' requests were handled in the same call
        for i in range(1, 5):
            assert got_a[i] == rp.VerifyResult(request_id=f"r{i}", reward=1.0, correct=True)
            assert got_b[i] == rp.VerifyResult(request_id=f"r{i}", reward=0.0, correct=False)
        assert a.poll(200) == 0 and b.poll(0) == 0  # nothing more, nothing crossed over


def test_a_client_that_disconnects_mid_batch_costs_the_others_nothing() -> None:
    scorer = Scorer()
    with (
        serving(scorer, max_batch=4, batch_window_s=10.0) as server,
        dealer(server.address) as b,
    ):
        a = zmq.Context.instance().socket(zmq.DEALER)
        a.linger = 0
        a.connect(server.address)
        a.send_multipart(hello())
        b.send_multipart(hello())
        a.send_multipart(verify(1, "block"))
        b.send_multipart(verify(1, "ok"))
        assert scorer.entered.wait(10)  # the batch holding both is being handled...
        a.close(0)  # ...when one client goes away
        scorer.release.set()
        got = replies(b, 2)
        assert isinstance(got[0], rp.Welcome)
        assert got[1] == rp.VerifyResult(request_id="r1", reward=1.0, correct=True)
        assert scorer.calls == [2]
        assert server.is_serving()
        assert_served_afterwards(server)


def test_serve_forever_runs_the_handler_in_the_calling_thread_until_shutdown() -> None:
    scorer = Scorer()
    server = rp.RpcServer("tcp://127.0.0.1:*", batch_handler=scorer, poll_s=0.02)
    address = server.listen()  # bound before serving: the address is known at once
    results: list[object] = []

    def client() -> None:
        try:
            with RpcClient(address, timeout_s=5, retries=0) as c:
                results.append(
                    c.call(rp.VerifyRequest(request_id="m", verifier="v", completion="ok", reference="ok"))
                )
        except Exception as err:  # reported below, in the test's thread
            results.append(err)
        finally:
            server.shutdown()

    thread = threading.Thread(target=client)
    thread.start()
    server.serve_forever()  # returns once the client thread calls shutdown()
    thread.join(10)
    server.stop()
    assert len(results) == 1 and isinstance(results[0], rp.transport.Reply), results
    assert results[0].message == rp.VerifyResult(request_id="m", reward=1.0, correct=True)
    assert scorer.threads == [threading.current_thread()]
    assert not server.is_serving()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"handler": lambda m, f: rp.Ack(), "batch_handler": lambda b: []},
        {"batch_handler": lambda b: [], "max_batch": 0},
    ],
)
def test_rpc_server_refuses_a_bad_configuration(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        rp.RpcServer("tcp://127.0.0.1:*", **kwargs)  # type: ignore[arg-type]
