"""Socket helpers: deadlines, handshake, retries, CURVE, and bad multipart input."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import rlax_protocol as rp
from rlax_protocol import (
    PROTOCOL_VERSION,
    MalformedMessageError,
    ProtocolTimeoutError,
    RemoteError,
    RpcClient,
    VersionMismatchError,
)


@contextmanager
def echo_server(
    *, speak_version: int = PROTOCOL_VERSION, curve: rp.CurveServerConfig | None = None, silent: bool = False
) -> Iterator[str]:
    """A ROUTER that answers Hello, echoes LatestQuery frames back, and errors on anything else."""
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.linger = 0
    auth = rp.start_curve_server(context, socket, curve) if curve else None
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    peers = rp.PeerRegistry()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not socket.poll(20):
                continue
            request = rp.parse_request(socket.recv_multipart(copy=False))
            if silent:
                continue
            message = request.message
            if request.error is not None:
                reply: rp.Message = rp.ErrorReply(code="malformed", message=str(request.error))
            elif isinstance(message, rp.Hello):
                reply = rp.welcome_for(message, server_id="echo")
                if speak_version != PROTOCOL_VERSION:
                    reply = rp.Welcome(protocol_version=speak_version, server_id="echo", accepted=False)
                if reply.accepted:
                    peers.admit(request.identity)
            elif not peers.touch(request.identity):
                reply = rp.ErrorReply(code="handshake_required", message="say Hello first")
            elif isinstance(message, rp.LatestQuery):
                socket.send_multipart(
                    rp.reply_parts(
                        request.identity,
                        request.request_id,
                        rp.LatestVersion(version=len(request.frames)),
                        request.frames,
                    ),
                    copy=False,
                )
                continue
            else:
                reply = rp.ErrorReply(code="unknown_message", message=type(message).__name__)
            socket.send_multipart(rp.reply_parts(request.identity, request.request_id, reply))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)
        if auth is not None:
            auth.stop()
        socket.close(linger=0)
        context.term()


def test_call_round_trips_frames_without_copy() -> None:
    payload = np.arange(100_000, dtype=np.float32)
    with echo_server() as address, RpcClient(address, timeout_s=30) as client:
        reply = client.call(rp.LatestQuery(), [memoryview(payload).cast("B"), b"x"], expect=rp.LatestVersion)
        assert reply.message == rp.LatestVersion(version=2)
        assert np.array_equal(np.frombuffer(reply.frames[0].buffer, np.float32), payload)
        assert client.welcome is not None and client.welcome.server_id == "echo"


def test_remote_error_and_unexpected_type() -> None:
    with echo_server() as address, RpcClient(address, timeout_s=30) as client:
        with pytest.raises(RemoteError, match="unknown_message") as info:
            client.call(rp.StatQuery())
        assert info.value.code == "unknown_message" and address in str(info.value)
        with pytest.raises(MalformedMessageError, match="expected ServerStats"):
            client.call(rp.LatestQuery(), expect=rp.ServerStats)


def test_client_handshakes_again_when_server_forgets_it() -> None:
    with echo_server() as address, RpcClient(address, timeout_s=30) as client:
        client.connect()
        client.welcome = None
        # A fresh socket identity is unknown to the server until it says Hello; reset simulates a server restart.
        assert client._socket is not None
        client._socket.close(linger=0)
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.linger = 0
        socket.connect(address)
        client._socket = socket
        assert client.call(rp.LatestQuery(), expect=rp.LatestVersion).message.version == 0
        assert client.welcome is not None


def test_version_mismatch_names_both_versions_on_both_sides() -> None:
    other = PROTOCOL_VERSION + 41
    with echo_server(speak_version=other) as address, RpcClient(address, timeout_s=30, retries=0) as client:
        with pytest.raises(VersionMismatchError) as info:
            client.call(rp.LatestQuery())
        message = str(info.value)
        assert f"version {PROTOCOL_VERSION}" in message and f"version {other}" in message
    # Server side: a Hello of another version is refused with a reason naming both.
    assert rp.Handshake.answer(rp.Handshake.hello("c"), server_id="s").accepted
    welcome = rp.Handshake.answer(rp.Hello(protocol_version=other, client_id="c"), server_id="s")
    assert not welcome.accepted
    assert f"version {PROTOCOL_VERSION}" in welcome.reason and f"version {other}" in welcome.reason
    with pytest.raises(VersionMismatchError):
        rp.Handshake.check(welcome, peer="s")


def test_timeout_names_peer_and_operation_after_bounded_retries() -> None:
    with echo_server(silent=True) as address:
        client = RpcClient(address, timeout_s=0.1, retries=2, backoff_s=0.01)
        with pytest.raises(ProtocolTimeoutError) as info:
            client.call(rp.StatQuery())
        client.close()
    error = info.value
    assert isinstance(error, TimeoutError)
    assert address in str(error) and "StatQuery" in str(error) and error.attempts == 3


def test_recv_and_send_within_deadline() -> None:
    context = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    push = context.socket(zmq.PUSH)
    push.sndhwm = 1
    push.linger = 0
    pull.linger = 0
    try:
        with pytest.raises(ProtocolTimeoutError, match="receive weights with test-peer"):
            rp.recv_within(pull, timeout_s=0.05, peer="test-peer", operation="weights")
        # PUSH with no peer connected has nowhere to queue: the send times out.
        with pytest.raises(ProtocolTimeoutError, match="send weights with nobody"):
            rp.send_within(push, [b"x"], timeout_s=0.05, peer="nobody", operation="weights")
    finally:
        pull.close()
        push.close()


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.binary(max_size=40), max_size=6))
def test_parse_request_never_raises(parts: list[bytes]) -> None:
    request = rp.parse_request([zmq.Frame(p) for p in parts])
    assert (request.message is None) == (request.error is not None)


def test_curve_allows_only_listed_clients(tmp_path) -> None:
    server_keys = rp.generate_curve_keypair()
    public_path, secret_path = rp.save_curve_keypair(str(tmp_path), "client")
    allowed = rp.load_curve_keypair(secret_path)
    assert rp.load_curve_public_key(public_path) == allowed.public
    config = rp.CurveServerConfig(keypair=server_keys, allowed_clients=frozenset({allowed.public}))
    with echo_server(curve=config) as address:
        good = RpcClient(
            address,
            timeout_s=30,
            curve=rp.CurveClientConfig(keypair=allowed, server_public=server_keys.public),
        )
        assert good.call(rp.LatestQuery(), expect=rp.LatestVersion).message.version == 0
        good.close()
        stranger = rp.CurveClientConfig(keypair=rp.generate_curve_keypair(), server_public=server_keys.public)
        bad = RpcClient(address, timeout_s=0.3, retries=0, curve=stranger)
        with pytest.raises(ProtocolTimeoutError):
            bad.call(rp.LatestQuery())
        bad.close()
        plain = RpcClient(address, timeout_s=0.3, retries=0)
        with pytest.raises(ProtocolTimeoutError):
            plain.call(rp.LatestQuery())
        plain.close()


def test_rpc_server_handshake_handler_and_errors() -> None:
    def handler(message: rp.Message, frames: list[zmq.Frame]):
        if isinstance(message, rp.VerifyRequest):
            if message.verifier == "boom":
                raise ValueError("verifier exploded")
            if message.verifier == "unknown":
                raise RemoteError("not_found", f"no verifier {message.verifier!r}")
            correct = message.completion.strip() == message.reference
            return rp.VerifyResult(request_id=message.request_id, reward=float(correct), correct=correct)
        if isinstance(message, rp.LatestQuery):
            return rp.LatestVersion(version=len(frames)), frames
        raise RemoteError("unknown_message", type(message).__name__)

    with rp.RpcServer("tcp://127.0.0.1:*", handler, server_id="verifier") as server:
        with RpcClient(server.address, timeout_s=30) as client:
            request = rp.VerifyRequest(request_id="a", verifier="exact_match", completion=" 4", reference="4")
            assert client.call(request, expect=rp.VerifyResult).message == rp.VerifyResult(
                request_id="a", reward=1.0, correct=True
            )
            echoed = client.call(rp.LatestQuery(), [b"x" * 100_000], expect=rp.LatestVersion)
            assert echoed.message.version == 1 and echoed.frames[0].bytes == b"x" * 100_000
            with pytest.raises(RemoteError, match="internal.*verifier exploded"):
                client.call(rp.VerifyRequest(request_id="b", verifier="boom", completion=""))
            with pytest.raises(RemoteError, match="not_found"):
                client.call(rp.VerifyRequest(request_id="c", verifier="unknown", completion=""))
            assert client.welcome is not None and client.welcome.server_id == "verifier"
        # Garbage and a missing handshake are answered, and the server keeps serving.
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.linger = 0
        socket.connect(server.address)
        try:
            for parts in ([b"garbage"], [rp.transport.pack_request_id(9), rp.encode(rp.LatestQuery())]):
                socket.send_multipart(parts)
                assert socket.poll(30_000)
                reply = rp.decode(socket.recv_multipart()[1])
                assert isinstance(reply, rp.ErrorReply) and reply.code in {"malformed", "handshake_required"}
        finally:
            socket.close()
        with RpcClient(server.address, timeout_s=30) as client:
            assert client.call(rp.LatestQuery(), expect=rp.LatestVersion).message.version == 0


def test_rpc_server_survives_ten_thousand_hostile_requests_then_answers() -> None:
    calls = {"n": 0}

    def handler(message: rp.Message, frames: list[zmq.Frame]):
        calls["n"] += 1
        if isinstance(message, rp.LatestQuery):
            return rp.LatestVersion(version=7)
        if isinstance(message, rp.StatQuery):
            return rp.Ack(), [object()]  # a reply frame the socket cannot send
        raise RemoteError("unknown_message", type(message).__name__)

    valid = [rp.encode(rp.LatestQuery()), rp.encode(rp.StatQuery()), rp.encode(rp.Hello(protocol_version=1))]
    with rp.RpcServer("tcp://127.0.0.1:*", handler, server_id="fuzzed") as server:
        requests = list(rp.fuzzing.hostile_requests(10_000, seed=3, valid=valid))
        # Every request is answered, so blast never waits out settle_s: it only bounds a hang
        # (a server silent that long under load would have its requests written off).
        replies = rp.fuzzing.blast(server.address, requests, settle_s=60.0)
        # Every request is answered (a bad one with an error), including the first Hello.
        assert replies == len(requests) + 1
        assert calls["n"] > 0
        with RpcClient(server.address, timeout_s=30, retries=0) as client:
            assert client.call(rp.LatestQuery(), expect=rp.LatestVersion).message.version == 7
            with pytest.raises(RemoteError, match="internal"):
                client.call(rp.StatQuery())
            assert client.call(rp.LatestQuery(), expect=rp.LatestVersion).message.version == 7


def test_blast_fails_fast_when_the_server_stops_answering() -> None:
    # A ROUTER that reads but never answers stands for a server whose loop died: the fuzzer
    # must raise within a few waits, not spend one wait per remaining request (10,000 s).
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    requests = [[rp.fuzzing.request_id_part(n), rp.encode(rp.LatestQuery())] for n in range(10_000)]
    try:
        with pytest.raises(TimeoutError, match="answered none"):
            rp.fuzzing.blast(f"tcp://127.0.0.1:{port}", requests, settle_s=0.05, max_silent_waits=3)
    finally:
        router.close(0)


def test_peer_registry_stays_bounded_under_reconnect_churn() -> None:
    peers = rp.PeerRegistry(idle_timeout_s=600.0, max_peers=3)
    for n in range(1000):  # every reconnection is a new ZeroMQ identity
        peers.admit(f"conn-{n}".encode(), client_id="trainer" if n % 2 else "")
    assert peers.count() == 3
    assert peers.touch(b"conn-999") and not peers.touch(b"conn-0")
    # The client key survives reconnection when the client named itself.
    assert peers.client_key(b"conn-999") == peers.client_key(b"conn-997") == b"id:trainer"
    assert peers.client_key(b"conn-998") == b"conn:conn-998"
    # Touching keeps a client: the least recently seen one is forgotten first.
    peers.touch(b"conn-997")
    peers.admit(b"new")
    assert peers.touch(b"conn-997") and not peers.touch(b"conn-998")


def test_peer_registry_drops_idle_clients_on_admission() -> None:
    peers = rp.PeerRegistry(idle_timeout_s=0.05)
    for n in range(100):
        peers.admit(f"old-{n}".encode())
    time.sleep(0.1)  # what is tested: every old client idle past idle_timeout_s (no other party)
    peers.admit(b"fresh")
    assert len(peers._seen) == 1 and peers.touch(b"fresh")
