"""`rlax-verifier` batch messages: one message carries many items, a bad item fails
alone, a bad message is answered and the service keeps serving, and replies reach the
client that asked (in order, whatever the chunking)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

import rlax_protocol as rp
from rlax_data import Record
from rlax_data import verifier_wire as service
from rlax_data.tasks import ArithmeticTask
from rlax_data.verifier_process import RemoteVerifier, VerifierService, encode_batch
from rlax_data.verify.answers import ExactMatchVerifier
from rlax_data.verify.base import VerifyResult
from rlax_data.verify.countdown import CountdownVerifier
from rlax_data.verify.registry import RoutingVerifier
from rlax_protocol.transport import pack_request_id, unpack_request_id


class Gate:
    """A verifier that waits for `release` (so a test can act while a batch is scored)
    and returns details that cannot be encoded for completion ``unencodable``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def verify(self, items):
        self.entered.set()
        assert self.release.wait(10)
        return [
            VerifyResult(reward=1.0, correct=True, details={"x": object()} if c == "unencodable" else {})
            for c, _ in items
        ]


@contextmanager
def running(**kwargs) -> Iterator[tuple[VerifierService, Gate]]:
    gate = Gate()
    routes = RoutingVerifier(
        {"arithmetic": ExactMatchVerifier(), "countdown": CountdownVerifier(), "gate": gate}
    )
    svc = VerifierService(routes, address="tcp://127.0.0.1:*", poll_s=0.05, **kwargs)
    thread = threading.Thread(target=svc.serve, daemon=True)
    thread.start()
    try:
        yield svc, gate
    finally:
        svc.stop()
        thread.join(timeout=10)
        svc.close()
    assert not thread.is_alive()


@contextmanager
def dealer(address: str) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    hello = rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id="t")
    sock.send_multipart([pack_request_id(0), rp.encode(hello)])
    try:
        assert isinstance(_reply(sock)[1], rp.Welcome)
        yield sock
    finally:
        sock.close(0)


def _reply(sock: zmq.Socket) -> tuple[int, rp.Message, list[zmq.Frame]]:
    parts = rp.recv_within(sock, timeout_s=10, peer="verifier", operation="reply")
    return unpack_request_id(parts[0]), rp.decode(parts[1].buffer), list(parts[2:])


def _header(n: int) -> bytes:
    return rp.encode(rp.VerifyBatch(request_id="b", items=n))


def _arith(n: int, seed: int = 0) -> list[tuple[str, Record]]:
    """n arithmetic items, the odd ones answered right."""
    return [(r.answer if i % 2 else "nope", r) for i, r in enumerate(ArithmeticTask().generate(n, seed=seed))]


def _record_json(record: Record) -> bytes:
    return msgspec.json.encode(record)


def test_a_batch_with_bad_items_scores_the_good_ones_and_refuses_each_bad_one():
    good = _arith(4)
    countdown_without_numbers = Record(id="cd", prompt="p", answer="3", task="countdown")
    unrouted = Record(id="u", prompt="p", answer="1", task="nope")
    items = [
        b'["' + good[0][0].encode() + b'",' + _record_json(good[0][1]) + b"]",
        b'["1",{"id":"","prompt":"p","answer":"1","task":"arithmetic"}]',  # Record refuses an empty id
        b'["' + good[1][0].encode() + b'",' + _record_json(good[1][1]) + b"]",
        b'["1+2",' + _record_json(countdown_without_numbers) + b"]",  # its verifier refuses it
        b'[1, {"id": 3}]',  # wrong types
        b'["1",' + _record_json(unrouted) + b"]",
        b'["x",' + _record_json(Record(id="g", prompt="p", answer="1", task="gate")) + b"]",
        b'["unencodable",' + _record_json(Record(id="h", prompt="p", answer="1", task="gate")) + b"]",
        b'["' + good[3][0].encode() + b'",' + _record_json(good[3][1]) + b"]",
    ]
    frame = b"[" + b",".join(items) + b"]"
    with running() as (svc, _), dealer(svc.bound_address) as sock:
        sock.send_multipart([pack_request_id(1), _header(len(items)), frame])
        rid, reply, frames = _reply(sock)
        assert rid == 1 and isinstance(reply, rp.VerifyBatchResult) and reply.refused == 5
        assert reply.items == 9  # four of nine scored
        outcome = msgspec.json.decode(frames[0].bytes)
        refused = {n: code for n, code, _ in outcome["refused"]}
        assert refused == {1: "malformed", 3: "bad_request", 4: "malformed", 5: "not_found", 7: "internal"}
        results = outcome["results"]
        assert [r is None for r in results] == [n in refused for n in range(len(items))]
        assert [results[n]["correct"] for n in (0, 2, 6, 8)] == [False, True, True, True]
        # The service keeps serving, and a client is told which item was refused.
        remote = RemoteVerifier(svc.bound_address, timeout_s=10)
        try:
            assert [r.correct for r in remote.verify(good)] == [False, True, False, True]
            with pytest.raises(rp.RemoteError, match=r"not_found.*item 4"):
                remote.verify([*good, ("1", unrouted)])
        finally:
            remote.close()


@pytest.mark.parametrize(
    ("parts", "code"),
    [
        ([_header(1), b"[" * 20_000 + b"]" * 20_000], "malformed"),  # nesting msgspec would recurse into
        (
            [
                _header(1),
                b'[["1", {"id":"x","prompt":"p","answer":"1","metadata":'
                + b"[" * 5000
                + b"]" * 5000
                + b"}]]",
            ],
            "malformed",
        ),
        ([_header(1), b"\xff\xfe not json"], "malformed"),
        ([_header(1), b'{"not": "an array"}'], "malformed"),
        (
            [_header(2), b'[["1", {"id":"x","prompt":"p","answer":"1","task":"arithmetic"}]]'],
            "malformed",
        ),  # count lies
        ([_header(1)], "malformed"),  # no frame
        ([_header(1), b"[]", b"[]"], "malformed"),  # two frames
        (
            [_header(3), b"[" + b",".join([b'["1",{"id":"x","prompt":"p","answer":"1"}]'] * 3) + b"]"],
            "too_large",
        ),
        ([_header(1), b"[" + b" " * 70_000 + b"]"], "too_large"),  # over max_request_bytes
        (
            [rp.encode(rp.VerifyRequest(request_id="s", verifier="arithmetic", completion="1")), b"[]"],
            "malformed",
        ),
    ],
)
def test_a_hostile_batch_message_is_answered_and_the_service_keeps_serving(parts, code):
    with running(max_items=2, max_request_bytes=64_000) as (svc, _), dealer(svc.bound_address) as sock:
        sock.send_multipart([pack_request_id(7), *parts])
        rid, reply, _ = _reply(sock)
        assert rid == 7 and isinstance(reply, rp.ErrorReply) and reply.code == code, reply
        items = _arith(2)
        sock.send_multipart([pack_request_id(8), _header(2), encode_batch(items)])
        rid, reply, frames = _reply(sock)
        assert rid == 8 and isinstance(reply, rp.VerifyBatchResult) and reply.refused == 0
        assert [r["correct"] for r in msgspec.json.decode(frames[0].bytes)["results"]] == [False, True]


@pytest.mark.parametrize(("chunk_items", "chunk_bytes"), [(7, 1 << 20), (1000, 600), (3, 1)])
def test_remote_verifier_chunks_and_keeps_the_order(chunk_items, chunk_bytes):
    items = _arith(30, seed=4)
    want = [(r.reward, r.correct, r.details) for r in ExactMatchVerifier().verify(items)]
    with running() as (svc, _):
        remote = RemoteVerifier(
            svc.bound_address, timeout_s=10, chunk_items=chunk_items, chunk_bytes=chunk_bytes
        )
        try:
            got = remote.verify(items)
        finally:
            remote.close()
        assert [(r.reward, r.correct, r.details) for r in got] == want
        assert svc.stats["items"] == 30
        assert svc.stats["requests"] >= (30 + chunk_items - 1) // chunk_items
        if chunk_bytes == 1:  # every item over the byte budget: one item a message
            assert svc.stats["requests"] == 30


def test_oversize_chunks_are_refused_unless_the_client_splits_them():
    items = _arith(40)
    with running(max_request_bytes=4000) as (svc, _):
        whole = RemoteVerifier(svc.bound_address, timeout_s=10)
        split = RemoteVerifier(svc.bound_address, timeout_s=10, chunk_bytes=3000)
        try:
            with pytest.raises(rp.RemoteError, match="too_large"):
                whole.verify(items)
            assert [r.correct for r in split.verify(items)] == [bool(i % 2) for i in range(40)]
        finally:
            whole.close()
            split.close()


def test_concurrent_clients_each_get_their_own_results():
    sets = [_arith(50, seed=s) for s in range(4)]
    want = [[(r.correct, r.details) for r in ExactMatchVerifier().verify(items)] for items in sets]
    got: dict[int, object] = {}

    def client(k: int) -> None:
        remote = RemoteVerifier(svc.bound_address, timeout_s=20, chunk_items=9)
        try:
            for _ in range(5):
                res = remote.verify(sets[k])
                got.setdefault(k, [])
                got[k].append([(r.correct, r.details) for r in res])  # type: ignore[union-attr]
        except Exception as err:
            got[k] = err
        finally:
            remote.close()

    with running() as (svc, _):
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert svc.stats["batches"] < svc.stats["requests"]  # messages waiting together shared a call
    for k in range(4):
        assert got[k] == [want[k]] * 5, (k, got[k] if isinstance(got[k], Exception) else "wrong results")


def test_a_client_that_leaves_mid_batch_costs_the_others_nothing():
    with running() as (svc, gate), dealer(svc.bound_address) as stays:
        gate.release.clear()
        leaves = zmq.Context.instance().socket(zmq.DEALER)
        leaves.linger = 0
        leaves.connect(svc.bound_address)
        hello = rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id="l")
        leaves.send_multipart([pack_request_id(0), rp.encode(hello)])
        assert isinstance(_reply(leaves)[1], rp.Welcome)
        gated = [("x", Record(id="g", prompt="p", answer="1", task="gate"))] * 3
        leaves.send_multipart([pack_request_id(1), _header(3), encode_batch(gated)])
        assert gate.entered.wait(10)  # its batch is being scored...
        stays.send_multipart([pack_request_id(1), _header(2), encode_batch(_arith(2))])
        leaves.close(0)  # ...when it goes away, its reply still to be sent
        gate.release.set()
        rid, reply, frames = _reply(stays)
        assert rid == 1 and isinstance(reply, rp.VerifyBatchResult) and reply.refused == 0
        assert [r["correct"] for r in msgspec.json.decode(frames[0].bytes)["results"]] == [False, True]
        assert svc.server.is_serving()


def test_a_large_frame_is_counted_before_its_records_are_built(monkeypatch):
    built = []
    real = service._PAIRS_DECODER

    class Spy:
        def decode(self, data):
            built.append(len(data))
            return real.decode(data)

    monkeypatch.setattr(service, "_PAIRS_DECODER", Spy())
    tiny = b'["1",{"id":"x","prompt":"","answer":"1","task":"arithmetic"}]'
    frame = b"[" + b",".join([tiny] * 30_000) + b"]"  # 1.9 MB of tiny items
    assert len(frame) > service._COUNT_FIRST_BYTES
    with running(max_items=1000) as (svc, _), dealer(svc.bound_address) as sock:
        sock.send_multipart([pack_request_id(1), _header(30_000), frame])
        _, reply, _ = _reply(sock)
        assert isinstance(reply, rp.ErrorReply) and reply.code == "too_large" and "30000" in reply.message
        assert built == []  # refused on its count alone
        sock.send_multipart([pack_request_id(2), _header(1), b"[" + tiny + b"]"])
        _, reply, _ = _reply(sock)
        assert isinstance(reply, rp.VerifyBatchResult) and reply.refused == 0 and built
