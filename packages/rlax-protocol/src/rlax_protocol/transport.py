"""ZeroMQ helpers in which every send and receive has a deadline.

Request/reply framing (DEALER client <-> ROUTER server)::

    client -> server:  [request_id (8 bytes, little-endian), message (msgpack), *raw frames]
    server sees:       [identity, request_id, message, *raw frames]   (ROUTER prepends identity)
    server -> client:  [identity, request_id, reply, *raw frames]

The request id lets a client keep several requests in flight (pipelining) and drop
late replies to requests it already gave up on. A client opens each connection with
`Hello`; the server answers `Welcome` (or refuses it when the protocol versions
differ, and the client raises `VersionMismatchError` naming both).

Frames larger than `ZERO_COPY_THRESHOLD` are sent with ``copy=False`` and received as
`zmq.Frame`s whose buffers the codec wraps without copying.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from rlax_protocol.auth import Credential, ServerAuth, client_credential
from rlax_protocol.errors import (
    MalformedMessageError,
    ProtocolTimeoutError,
    RemoteError,
    VersionMismatchError,
)
from rlax_protocol.messages import PROTOCOL_VERSION, ErrorReply, Hello, Message, Welcome, decode, encode

log = logging.getLogger(__name__)

ZERO_COPY_THRESHOLD = 64 * 1024
DEFAULT_TIMEOUT_S = 10.0
_REQUEST_ID_BYTES = 8

Part = bytes | memoryview | zmq.Frame
M = TypeVar("M", bound=Message)


class Deadline:
    """A point in monotonic time; `remaining()` never goes below zero."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s={timeout_s}: must be >= 0")
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._end


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)  # plain ints: combining the enum flags per part costs ~3 us
_LAST = int(zmq.NOBLOCK)


def send_within(
    socket: zmq.Socket[Any], parts: Sequence[Part], *, timeout_s: float, peer: str, operation: str
) -> None:
    """Send a multipart message, waiting at most `timeout_s` for room in the send queue."""
    if not socket.poll(_ms(timeout_s), zmq.POLLOUT):
        raise ProtocolTimeoutError(peer, f"send {operation}", timeout_s)
    last = len(parts) - 1
    try:
        for i, part in enumerate(parts):
            flags = _MORE if i < last else _LAST
            big = not isinstance(part, zmq.Frame) and memoryview(part).nbytes >= ZERO_COPY_THRESHOLD
            socket.send(part, flags, copy=not big, track=False)
    except zmq.Again:
        # Once the first part is queued ZeroMQ accepts the rest atomically; Again here means none went.
        raise ProtocolTimeoutError(peer, f"send {operation}", timeout_s) from None


def recv_within(socket: zmq.Socket[Any], *, timeout_s: float, peer: str, operation: str) -> list[zmq.Frame]:
    """Receive one multipart message as `zmq.Frame`s (no copy), waiting at most `timeout_s`."""
    if not socket.poll(_ms(timeout_s), zmq.POLLIN):
        raise ProtocolTimeoutError(peer, f"receive {operation}", timeout_s)
    return socket.recv_multipart(zmq.NOBLOCK, copy=False)


def pack_request_id(request_id: int) -> bytes:
    return request_id.to_bytes(_REQUEST_ID_BYTES, "little")


def unpack_request_id(part: Part) -> int:
    view = part.buffer if isinstance(part, zmq.Frame) else memoryview(part)
    if view.nbytes != _REQUEST_ID_BYTES:
        raise MalformedMessageError(
            f"request id frame holds {view.nbytes} bytes, expected {_REQUEST_ID_BYTES}"
        )
    return int.from_bytes(view, "little")


@dataclass
class Request:
    """A request as a ROUTER server sees it; `message` is None when it could not be decoded."""

    identity: bytes
    request_id: int
    message: Message | None
    frames: list[zmq.Frame]
    error: MalformedMessageError | None = None


def parse_request(parts: Sequence[zmq.Frame]) -> Request:
    """Split ``[identity, request_id, message, *frames]``; never raises on bad input.

    A request whose id or message cannot be read comes back with `error` set (and
    request id 0 when unreadable) so the server can still answer with an `ErrorReply`.
    The message is decoded by `decode`, which bounds nesting depth and size first.
    """
    if not parts:
        return Request(b"", 0, None, [], MalformedMessageError("empty multipart message"))
    try:
        identity = parts[0].bytes
    except Exception as err:  # not a frame at all: nothing to answer to
        return Request(b"", 0, None, [], MalformedMessageError(f"unreadable identity frame: {err}"))
    if len(parts) < 3:
        return Request(
            identity, 0, None, [], MalformedMessageError(f"request has {len(parts)} parts, needs >= 3")
        )
    request_id = 0
    try:
        request_id = unpack_request_id(parts[1])
        message = decode(parts[2].buffer)
    except MalformedMessageError as err:
        return Request(identity, request_id, None, [], err)
    except Exception as err:  # defence in depth: one message must never stop a server loop
        log.warning("unexpected %s while parsing a request", type(err).__name__, exc_info=True)
        return Request(identity, request_id, None, [], MalformedMessageError(f"{type(err).__name__}: {err}"))
    return Request(identity, request_id, message, list(parts[3:]))


def reply_parts(
    identity: bytes, request_id: int, message: Message, frames: Iterable[Part] = ()
) -> list[Part]:
    """The multipart list a ROUTER sends to answer request `request_id` of `identity`."""
    return [identity, pack_request_id(request_id), encode(message), *frames]


def welcome_for(hello: Hello, *, server_id: str) -> Welcome:
    """Server side of the handshake: refuse a client that speaks another protocol version."""
    if hello.protocol_version != PROTOCOL_VERSION:
        reason = str(
            VersionMismatchError(PROTOCOL_VERSION, hello.protocol_version, peer=f"client {hello.client_id!r}")
        )
        log.error("refusing %s", reason)
        return Welcome(protocol_version=PROTOCOL_VERSION, server_id=server_id, accepted=False, reason=reason)
    return Welcome(protocol_version=PROTOCOL_VERSION, server_id=server_id)


def check_welcome(welcome: Welcome, *, peer: str) -> None:
    """Client side of the handshake: raise `VersionMismatchError` naming both versions."""
    if welcome.protocol_version != PROTOCOL_VERSION or not welcome.accepted:
        raise VersionMismatchError(PROTOCOL_VERSION, welcome.protocol_version, peer=peer)


class Handshake:
    """The Hello/Welcome exchange in one place (`RpcClient` and `RpcServer` run it for you).

    Client: send `Handshake.hello(...)`, then `Handshake.check(welcome, peer=...)`.
    Server: answer a `Hello` with `Handshake.answer(hello, server_id=...)` and admit the
    peer only if the returned `Welcome.accepted`.
    """

    @staticmethod
    def hello(client_id: str = "", role: str = "") -> Hello:
        return Hello(protocol_version=PROTOCOL_VERSION, client_id=client_id, role=role)

    @staticmethod
    def answer(hello: Hello, *, server_id: str) -> Welcome:
        return welcome_for(hello, server_id=server_id)

    @staticmethod
    def check(welcome: Welcome, *, peer: str) -> None:
        check_welcome(welcome, peer=peer)


@dataclass
class _Peer:
    last_seen: float
    client_key: bytes


@dataclass
class PeerRegistry:
    """Server-side record of the clients that completed the handshake (thread-safe, bounded).

    A client idle for longer than `idle_timeout_s` is forgotten; its next request is
    answered ``handshake_required`` and `RpcClient` then says `Hello` again. Every
    reconnection gets a new ZeroMQ identity, so under reconnect churn the table would
    grow without end: it is kept in least-recently-seen order, idle entries are dropped
    from its old end on every admission, and beyond `max_peers` the least recently seen
    client is forgotten (it only has to say `Hello` again).

    `client_key(identity)` names the client behind a connection across reconnections:
    the ``client_id`` of its `Hello` when it gave one, else the connection itself.
    """

    idle_timeout_s: float = 300.0
    max_peers: int = 4096
    _seen: collections.OrderedDict[bytes, _Peer] = field(default_factory=collections.OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, identity: bytes, client_id: str = "") -> None:
        key = b"id:" + client_id.encode() if client_id else b"conn:" + identity
        now = time.monotonic()
        with self._lock:
            self._seen[identity] = _Peer(now, key)
            self._seen.move_to_end(identity)
            self._expire(now)
            while len(self._seen) > self.max_peers:
                self._seen.popitem(last=False)

    def touch(self, identity: bytes) -> bool:
        """True if `identity` said Hello and is not expired (and refreshes it)."""
        now = time.monotonic()
        with self._lock:
            peer = self._seen.get(identity)
            if peer is None or now - peer.last_seen > self.idle_timeout_s:
                self._seen.pop(identity, None)
                return False
            peer.last_seen = now
            self._seen.move_to_end(identity)
            return True

    def screen(
        self,
        identity: bytes,
        message: Message,
        *,
        server_id: str,
        auth: ServerAuth | None = None,
        role: str = "",
    ) -> Message | None:
        """What a server answers a well-formed request before serving it, or None to serve it.

        A `Hello` gets its `Welcome` (and a client speaking this protocol is admitted); a
        client that has not said Hello, or was forgotten since, gets ``handshake_required``
        (`RpcClient` then says Hello again); a message `auth` does not accept from `role`
        (the connection's authenticated role, `ServerAuth.role_of`) gets ``forbidden``.
        One place for the handshake and the permission check of every server.
        """
        if isinstance(message, Hello):
            welcome = welcome_for(message, server_id=server_id)
            if welcome.accepted:
                self.admit(identity, message.client_id)
            return welcome
        if not self.touch(identity):
            return ErrorReply(
                code="handshake_required", message="say Hello (with the protocol version) first"
            )
        return auth.refusal(role, message) if auth is not None else None

    def client_key(self, identity: bytes) -> bytes:
        """The key of the client behind `identity` (stable across its reconnections)."""
        with self._lock:
            peer = self._seen.get(identity)
        return peer.client_key if peer is not None else b"conn:" + identity

    def count(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return len(self._seen)

    def _expire(self, now: float) -> None:
        # Oldest first: stop at the first entry still fresh.
        while self._seen:
            identity, peer = next(iter(self._seen.items()))
            if now - peer.last_seen <= self.idle_timeout_s:
                return
            del self._seen[identity]


# --------------------------------------------------------------------------- CURVE


@dataclass(frozen=True)
class CurveKeyPair:
    """A CURVE key pair as z85-encoded bytes (40 characters each)."""

    public: bytes
    secret: bytes


def generate_curve_keypair() -> CurveKeyPair:
    """A fresh CURVE key pair (`zmq.curve_keypair`)."""
    public, secret = zmq.curve_keypair()
    return CurveKeyPair(public=public, secret=secret)


def save_curve_keypair(directory: str, name: str) -> tuple[str, str]:
    """Write ZeroMQ certificate files ``name.key`` (public) and ``name.key_secret``; returns both paths."""
    os.makedirs(directory, exist_ok=True)
    public_path, secret_path = zmq.auth.create_certificates(directory, name)
    return str(public_path), str(secret_path)


def load_curve_keypair(path: str) -> CurveKeyPair:
    """Read a ZeroMQ certificate file; a secret file yields both keys."""
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path}: holds only a public key; a key pair needs the .key_secret file")
    return CurveKeyPair(public=public, secret=secret)


def load_curve_public_key(path: str) -> bytes:
    """Read the public key of a ZeroMQ certificate file."""
    public, _ = zmq.auth.load_certificate(path)
    return public


@dataclass(frozen=True)
class CurveClientConfig:
    """What a client needs to talk to a CURVE server: its own key pair and the server's public key."""

    keypair: CurveKeyPair
    server_public: bytes


@dataclass(frozen=True)
class CurveServerConfig:
    """A server's key pair and the public keys of the clients it admits."""

    keypair: CurveKeyPair
    allowed_clients: frozenset[bytes]


def apply_curve_client(socket: zmq.Socket[Any], config: CurveClientConfig) -> None:
    socket.curve_secretkey = config.keypair.secret
    socket.curve_publickey = config.keypair.public
    socket.curve_serverkey = config.server_public


class _AllowList:
    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        admitted = zmq.utils.z85.encode(key) in self.allowed if len(key) == 32 else key in self.allowed
        if not admitted:
            log.warning("CURVE: rejected a client whose public key is not allowed")
        return admitted


def start_curve_server(
    context: zmq.Context[Any], socket: zmq.Socket[Any], config: CurveServerConfig
) -> ThreadAuthenticator:
    """Make `socket` a CURVE server admitting only `config.allowed_clients`; returns the
    running ZAP authenticator (stop it when the socket closes). Call before `bind`."""
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(config.allowed_clients))
    socket.curve_server = True
    socket.curve_secretkey = config.keypair.secret
    socket.curve_publickey = config.keypair.public
    return auth


# --------------------------------------------------------------------------- client

RESOLVE_EVERY_S = 1.0
"""How often a client with a `resolve` looks its server's address up while it waits."""


@dataclass
class Reply:
    message: Message
    frames: list[zmq.Frame]


class RpcClient:
    """A DEALER client with a deadline on every call and bounded retries with backoff.

    On a timeout the socket is closed and reopened (dropping queued replies), the
    handshake is redone and the request resent, up to `retries` times, sleeping
    ``backoff_s * 2**attempt`` (capped, jittered) in between. An `ErrorReply` raises
    `RemoteError` at once (the server did answer). Not thread-safe: one caller at a time.

    `resolve`: called before each (re)connect for the server's address now (the run's
    address book), and every `RESOLVE_EVERY_S` while a reply is awaited: a wait for a
    server that moved ends as a timeout at once, and the retry connects to the new address.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        client_id: str = "",
        role: str = "",
        curve: CurveClientConfig | None = None,
        credential: Credential | None = None,
        context: zmq.Context[Any] | None = None,
        resolve: Callable[[], str] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        if retries < 0:
            raise ValueError(f"retries={retries}: must be >= 0")
        self.address = address
        self.peer = f"server {address}"
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.role = role
        self.curve = curve
        # The run's credential (this process's, unless given): it authenticates the connection.
        self.credential = client_credential(credential) if curve is None else None
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket[Any] | None = None
        self._next_id = 1
        self.welcome: Welcome | None = None
        self.resolve = resolve

    # -- connection

    def _open(self, timeout_s: float) -> zmq.Socket[Any]:
        if self.resolve is not None and (address := self.resolve()) != self.address:
            self.address, self.peer = address, f"server {address}"
        socket: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        socket.linger = 0
        if self.curve is not None:
            apply_curve_client(socket, self.curve)
        elif self.credential is not None:
            self.credential.apply_client(socket)
        socket.connect(self.address)
        self._socket = socket
        try:
            request_id = self.send_request(
                Hello(protocol_version=PROTOCOL_VERSION, client_id=self.client_id, role=self.role)
            )
            reply = self.recv_reply({request_id}, timeout_s=timeout_s, operation="Hello")[1]
        except BaseException:
            self.reset()
            raise
        if isinstance(reply.message, ErrorReply):
            self.reset()
            raise RemoteError(reply.message.code, reply.message.message, peer=self.peer)
        if not isinstance(reply.message, Welcome):
            self.reset()
            raise MalformedMessageError(f"{self.peer} answered Hello with {type(reply.message).__name__}")
        try:
            check_welcome(reply.message, peer=self.peer)
        except VersionMismatchError:
            self.reset()
            raise
        self.welcome = reply.message
        return socket

    def connect(self, *, timeout_s: float | None = None) -> None:
        """Connect and handshake now (otherwise the first call does it)."""
        if self._socket is None:
            self._open(timeout_s or self.timeout_s)

    def reset(self) -> None:
        """Drop the connection; the next call reconnects and handshakes again."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def close(self) -> None:
        self.reset()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- pipelined primitives

    def send_request(
        self, message: Message, frames: Sequence[Part] = (), *, timeout_s: float | None = None
    ) -> int:
        """Send one request without waiting for its reply; returns its request id."""
        if self._socket is None:
            self._open(timeout_s or self.timeout_s)
        assert self._socket is not None
        request_id = self._next_id
        self._next_id += 1
        parts: list[Part] = [pack_request_id(request_id), encode(message), *frames]
        send_within(
            self._socket,
            parts,
            timeout_s=timeout_s or self.timeout_s,
            peer=self.peer,
            operation=type(message).__name__,
        )
        return request_id

    def recv_reply(self, pending: set[int], *, timeout_s: float, operation: str) -> tuple[int, Reply]:
        """Wait for the reply to any request id in `pending`; late replies to others are dropped."""
        if self._socket is None:
            raise ProtocolTimeoutError(self.peer, f"receive {operation} (not connected)", timeout_s)
        deadline = Deadline(timeout_s)
        while True:
            wait = deadline.remaining()
            if self.resolve is not None:
                wait = min(wait, RESOLVE_EVERY_S)  # a server that moved is not waited for
            try:
                parts = recv_within(self._socket, timeout_s=wait, peer=self.peer, operation=operation)
            except ProtocolTimeoutError:
                if self.resolve is None:
                    raise
                if deadline.expired():
                    raise ProtocolTimeoutError(self.peer, f"receive {operation}", timeout_s) from None
                if (address := self.resolve()) != self.address:
                    raise ProtocolTimeoutError(
                        self.peer, f"receive {operation} (the server moved to {address})", timeout_s
                    ) from None
                continue
            if len(parts) < 2:
                raise MalformedMessageError(f"{self.peer} sent a reply of {len(parts)} parts")
            request_id = unpack_request_id(parts[0])
            if request_id not in pending:
                continue  # a reply to a request we already gave up on
            return request_id, Reply(decode(parts[1].buffer), list(parts[2:]))

    # -- calls

    def backoff(self, attempt: int) -> float:
        delay: float = min(self.max_backoff_s, self.backoff_s * (2.0**attempt))
        return delay * (0.5 + random.random() / 2)

    def call(
        self,
        message: Message,
        frames: Sequence[Part] = (),
        *,
        expect: type[M] | tuple[type[M], ...] | None = None,
        timeout_s: float | None = None,
        retry: bool = True,
    ) -> Reply:
        """Send `message` and wait for its reply; retried on timeout if `retry` (idempotent calls only).

        Raises `RemoteError` for an `ErrorReply`, `MalformedMessageError` for a reply of
        another type than `expect`, `ProtocolTimeoutError` once every attempt timed out.
        """
        timeout = timeout_s or self.timeout_s
        attempts = (self.retries if retry else 0) + 1
        operation = type(message).__name__
        handshake_retry = True
        attempt = 0
        while True:
            try:
                request_id = self.send_request(message, frames, timeout_s=timeout)
                _, reply = self.recv_reply({request_id}, timeout_s=timeout, operation=operation)
            except ProtocolTimeoutError:
                self.reset()
                attempt += 1
                if attempt >= attempts:
                    raise ProtocolTimeoutError(self.peer, operation, timeout, attempts=attempts) from None
                time.sleep(self.backoff(attempt - 1))
                continue
            if isinstance(reply.message, ErrorReply):
                if reply.message.code == "handshake_required" and handshake_retry:
                    # The server forgot us (restart or idle expiry): handshake again once.
                    handshake_retry = False
                    self.reset()
                    continue
                raise RemoteError(reply.message.code, reply.message.message, peer=self.peer)
            if expect is not None and not isinstance(reply.message, expect):
                names = (
                    expect.__name__ if isinstance(expect, type) else " or ".join(t.__name__ for t in expect)
                )
                raise MalformedMessageError(
                    f"{self.peer} answered {operation} with {type(reply.message).__name__}, expected {names}"
                )
            return reply
