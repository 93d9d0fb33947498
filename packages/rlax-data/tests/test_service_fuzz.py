"""`rlax-verifier` under 10,000 hostile messages: every one is answered, the loop never
stops, and a correct request is still scored afterwards.

The messages mix deep nesting (bare, inside a VerifyRequest's fields, and as JSON in
`extra["record"]`), huge declared lengths, wrong framing, truncations, records a
verifier refuses, verifiers that raise or return what cannot be sent, and valid
requests whose verdicts are checked.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

import rlax_protocol as rp
from rlax_data import Record
from rlax_data.verifier_process import RemoteVerifier, VerifierService
from rlax_data.verify.answers import ExactMatchVerifier
from rlax_data.verify.base import VerifyResult
from rlax_data.verify.countdown import CountdownVerifier
from rlax_data.verify.registry import RoutingVerifier
from rlax_protocol import rpc_server
from rlax_protocol.fuzzing import blast, hostile_requests
from rlax_protocol.transport import pack_request_id

MESSAGES = 10_000
DEEP_MSGPACK = b"\x81\xa1a" * 1000 + b"\xc0"  # the 3,001 bytes that stopped the parameter server
HUGE_LENGTHS = (
    b"\xdd\xff\xff\xff\xff",  # array of 4 G items
    b"\xdf\xff\xff\xff\xff",  # map of 4 G pairs
    b"\xdb\xff\xff\xff\xff",  # str of 4 GB
    b"\xc6\xff\xff\xff\xff",  # bin of 4 GB
    b"\xdc\xff\xff",
    b"\xda\xff\xff",
)


class Explosive:
    """A verifier that fails in the ways a plug-in can: it raises deep inside, returns
    details that cannot be encoded, or returns the wrong number of results."""

    def verify(self, items):
        out = []
        for completion, _ in items:
            if completion == "recurse":
                raise RecursionError("maximum recursion depth exceeded")
            if completion == "unencodable":
                out.append(VerifyResult(reward=1.0, correct=True, details={"x": object()}))
            else:
                out.append(VerifyResult(reward=0.0, correct=False))
        if any(c == "short" for c, _ in items):
            out.pop()
        return out


def _routes() -> RoutingVerifier:
    return RoutingVerifier(
        {"arithmetic": ExactMatchVerifier(), "countdown": CountdownVerifier(), "explosive": Explosive()}
    )


def _good(rid: str, right: bool) -> rp.VerifyRequest:
    return rp.VerifyRequest(
        request_id=rid, verifier="arithmetic", completion="42" if right else "41", reference="42"
    )


def _countdown(rid: str) -> rp.VerifyRequest:
    record = Record(id=rid, prompt="3,5>8:", answer="3+5", metadata={"numbers": [3, 5], "target": 8})
    return rp.VerifyRequest(
        request_id=rid,
        verifier="countdown",
        completion="3+5",
        extra={"record": msgspec.json.encode(record).decode()},
    )


def _deep_json(depth: int) -> str:
    return '{"id":"x","prompt":"p","answer":"1","metadata":{"m":' + "[" * depth + "]" * depth + "}}"


def _splice(message: rp.Message, payload: bytes) -> bytes:
    """`message` encoded with one field's value replaced by raw msgpack `payload`."""
    fields = msgspec.to_builtins(message)
    marker = "\x00splice\x00"
    key = random.Random(len(payload)).choice([k for k in fields if k != "type"] + ["extra_field"])
    fields[key] = marker
    return msgspec.msgpack.encode(fields).replace(msgspec.msgpack.encode(marker), payload)


def hostile(count: int, seed: int) -> Iterator[tuple[list[bytes], bool | None]]:
    """(parts after the identity, expected `correct` for a valid request else None)."""
    rng = random.Random(seed)
    good = rp.encode(_good("g", True))
    for n in range(count):
        rid = pack_request_id(n + 1)
        kind = n % 12
        if kind == 0:  # bare deep nesting of maps, arrays, or both
            header = rng.choice([b"\x81\xa1a", b"\x91", b"\xdc\x00\x01"])
            yield (
                [
                    rid,
                    DEEP_MSGPACK if n % 24 == 0 else header * rng.choice([33, 1000, 5000, 100_000]) + b"\xc0",
                ],
                None,
            )
        elif kind == 1:  # huge declared lengths, bare or inside a valid request
            lie = rng.choice(HUGE_LENGTHS)
            yield (
                [rid, lie + rng.randbytes(rng.randint(0, 8)) if n % 2 else _splice(_good("h", True), lie)],
                None,
            )
        elif kind == 2:  # deep nesting inside a VerifyRequest field
            yield [rid, _splice(_good("d", True), b"\x91" * rng.choice([40, 3000]) + b"\xc0")], None
        elif kind == 3:  # deep JSON where the service decodes a record (msgspec recurses)
            req = rp.VerifyRequest(
                request_id="j",
                verifier="countdown",
                completion="1",
                extra={"record": _deep_json(rng.choice([50, 10_000]))},
            )
            yield [rid, rp.encode(req)], None
        elif kind == 4:  # a record its verifier refuses: Countdown without numbers or target
            yield (
                [rid, rp.encode(rp.VerifyRequest(request_id="r", verifier="countdown", completion="1+2"))],
                None,
            )
        elif kind == 5:  # wrong framing around a valid message
            yield (
                rng.choice(
                    [
                        [rng.randbytes(rng.choice([0, 3, 12])), good],
                        [rid],
                        [b"", b"", b""],
                        [rid, good, b"x" * 7, b""],
                    ]
                ),
                None,
            )
        elif kind == 6:  # truncated or flipped valid messages
            data = bytearray(rng.choice([good, rp.encode(_countdown("c"))]))
            if n % 2:
                data = data[: rng.randrange(len(data))]
            else:
                for _ in range(3):
                    data[rng.randrange(len(data))] = rng.randrange(256)
            yield [rid, bytes(data)], None
        elif kind == 7:
            yield [rid, rng.randbytes(rng.randint(0, 300))], None
        elif kind == 8:  # well-formed, but not served here or not for this server
            msg = rng.choice(
                [
                    rp.LatestQuery(),
                    rp.Welcome(protocol_version=rp.PROTOCOL_VERSION),
                    rp.Hello(protocol_version=rp.PROTOCOL_VERSION + 1000),
                    rp.VerifyRequest(request_id="n", verifier="nope", completion="1"),
                ]
            )
            yield [rid, rp.encode(msg)], None
        elif kind == 9:  # a verifier that raises or returns what cannot be sent
            completion = rng.choice(["recurse", "unencodable", "short", "fine"])
            yield (
                [
                    rid,
                    rp.encode(rp.VerifyRequest(request_id="x", verifier="explosive", completion=completion)),
                ],
                None,
            )
        else:  # valid requests, whose verdicts must come back right
            right = rng.random() < 0.5
            req = _good(f"ok-{n}", right) if kind == 10 else _countdown(f"ok-{n}")
            yield [rid, rp.encode(req)], (right if kind == 10 else True)


def _simulate_unguarded_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `parse_request` raise as it did before the protocol bounded nesting depth, so
    the test shows the service's loop survives whatever its protocol layer lets through."""
    real = rpc_server.parse_request

    def parse_request(parts):
        if len(parts) >= 3 and bytes(parts[2].buffer[:6]) in (
            b"\x81\xa1a\x81\xa1a",
            b"\x91\x91\x91\x91\x91\x91",
        ):
            raise RecursionError("maximum recursion depth exceeded while deserializing an object")
        return real(parts)

    monkeypatch.setattr(rpc_server, "parse_request", parse_request)


def assert_a_fresh_client_is_served(svc: VerifierService) -> None:
    """A new client's correct request is answered, and answered right."""
    remote = RemoteVerifier(client=rp.RpcClient(svc.bound_address, timeout_s=10), timeout_s=10)
    try:
        record = Record(id="after", prompt="6*7=", answer="42", task="arithmetic")
        (result,) = remote.verify([("42", record)])
    finally:
        remote.close()
    assert result.correct and result.reward == 1.0


@contextmanager
def running_service() -> Iterator[tuple[VerifierService, threading.Thread]]:
    """A verifier service serving in a thread of its own; stopped, joined and closed on exit."""
    svc = VerifierService(_routes(), address="tcp://127.0.0.1:*", batch_window_s=0.002, poll_s=0.05)
    thread = threading.Thread(target=svc.serve, daemon=True)
    thread.start()
    try:
        yield svc, thread
    finally:
        svc.stop()
        thread.join(timeout=10)
        svc.close()


@pytest.mark.parametrize("protocol", ["bounded", "raising"])
def test_service_survives_hostile_messages_and_still_answers(monkeypatch, protocol):
    if protocol == "raising":
        _simulate_unguarded_decode(monkeypatch)
    with running_service() as (svc, thread):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(svc.bound_address)
        codes: Counter[str] = Counter()
        verdicts: dict[str, bool] = {}
        expected: dict[str, bool] = {}

        def read_one() -> None:
            frames = rp.recv_within(sock, timeout_s=10, peer="verifier", operation="fuzz reply")
            reply = rp.decode(frames[1].buffer)
            if isinstance(reply, rp.ErrorReply):
                codes[reply.code] += 1
            elif isinstance(reply, rp.VerifyResult):
                codes["result"] += 1
                if reply.request_id.startswith("ok-"):
                    verdicts[reply.request_id] = reply.correct
            else:
                codes[type(reply).__name__] += 1

        try:
            # Unannounced clients are told to say Hello, hostile bytes or not.
            for parts, _ in hostile(24, seed=1):
                sock.send_multipart(parts)
            for _ in range(24):
                read_one()
            assert codes["handshake_required"] > 0
            codes.clear()
            hello = rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id="fuzz", role="test")
            sock.send_multipart([pack_request_id(0), rp.encode(hello)])
            read_one()
            outstanding = 0
            for parts, correct in hostile(MESSAGES, seed=0):
                if correct is not None:
                    expected[msgspec.msgpack.decode(parts[1])["request_id"]] = correct
                sock.send_multipart(parts)
                outstanding += 1
                if outstanding == 100:  # keep both queues short: read what was answered
                    for _ in range(outstanding):
                        read_one()
                    outstanding = 0
            for _ in range(outstanding):
                read_one()
        finally:
            sock.close(linger=0)
        # Every message got exactly one answer (the Hello's Welcome counted apart).
        assert sum(codes.values()) == MESSAGES + 1, codes
        assert {"malformed", "bad_request", "unknown_message", "not_found", "internal"} <= set(codes), codes
        assert verdicts == expected  # every valid request scored, and scored right
        assert thread.is_alive()
        assert_a_fresh_client_is_served(svc)


def test_service_survives_the_hostile_requests_every_server_faces():
    """The shared generator (`rlax_protocol.fuzzing`), mutating this service's own requests."""
    with running_service() as (svc, thread):
        valid = [
            rp.encode(_good("v", True)),
            rp.encode(_countdown("c")),
            rp.encode(rp.VerifyRequest(request_id="e", verifier="explosive", completion="recurse")),
        ]
        replies = blast(svc.bound_address, hostile_requests(MESSAGES, seed=3, valid=valid), settle_s=2.0)
        assert replies == MESSAGES + 1  # each request answered, and the Hello
        assert thread.is_alive()
        assert_a_fresh_client_is_served(svc)
