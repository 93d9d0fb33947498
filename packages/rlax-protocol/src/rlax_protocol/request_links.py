"""Non-blocking request links over ZeroMQ DEALER sockets, for the controller's event loop
and for the trainer's calls to the controller.

Framing is `rlax_protocol.transport`'s: ``[request_id (8 bytes LE), message, *frames]``.
A link opens with `Hello` and reads `Welcome`; the `server_id` in it tells a restarted
peer from the old one. Sends never block: a peer that is down or whose queue is full
makes `send` return False (ZMQ_IMMEDIATE keeps requests from queueing for a peer that
is not connected).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from rlax_protocol.auth import Credential, client_credential
from rlax_protocol.errors import MalformedMessageError, ProtocolTimeoutError, RemoteError
from rlax_protocol.messages import PROTOCOL_VERSION, ErrorReply, Hello, Message, Welcome
from rlax_protocol.transport import RESOLVE_EVERY_S, check_welcome, pack_request_id, unpack_request_id

__all__ = ["ControlClient", "PeerLink"]

Encoder = Callable[[Message], bytes]
Decoder = Callable[[bytes | memoryview | bytearray], Message]


class PeerLink:
    """One DEALER connection to a server, polled by the owner's loop (not thread-safe)."""

    def __init__(
        self,
        address: str,
        *,
        encode: Encoder,
        decode: Decoder,
        context: zmq.Context[Any],
        client_id: str = "",
        role: str = "",
        credential: Credential | None = None,
    ) -> None:
        self.address = address
        self.credential = client_credential(credential)
        self.encode = encode
        self.decode = decode
        self.context = context
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.role = role
        self.socket: zmq.Socket[Any] | None = None
        self.server_id: str | None = None
        self._next_id = 1
        self.open()

    def open(self) -> None:
        self.close()
        socket = self.context.socket(zmq.DEALER)
        socket.linger = 0
        socket.setsockopt(zmq.IMMEDIATE, 1)
        if self.credential is not None:
            self.credential.apply_client(socket)
        socket.connect(self.address)
        self.socket = socket

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

    def retarget(self, address: str) -> None:
        """Connect to the peer's new address (it moved to another node): a fresh socket, so
        nothing queued for the old one is sent, and the next Welcome is a new peer's."""
        self.address = address
        self.server_id = None
        self.open()

    def hello(self) -> int | None:
        return self.send(Hello(protocol_version=PROTOCOL_VERSION, client_id=self.client_id, role=self.role))

    def send(self, message: Message, frames: tuple[bytes, ...] = ()) -> int | None:
        """Queue `message`; returns its request id, or None if the peer cannot take it now."""
        if self.socket is None:
            return None
        request_id = self._next_id
        self._next_id += 1
        try:
            self.socket.send_multipart(
                [pack_request_id(request_id), self.encode(message), *frames], zmq.NOBLOCK
            )
        except zmq.Again:
            return None
        return request_id

    def receive(self) -> list[tuple[int, Message]]:
        """Every reply waiting on the socket (non-blocking). An unreadable reply, whatever
        the decoder raised on it, raises `MalformedMessageError`; a refused handshake raises
        `VersionMismatchError`."""
        out: list[tuple[int, Message]] = []
        if self.socket is None:
            return out
        while True:
            try:
                parts = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(parts) < 2:
                raise MalformedMessageError(f"peer {self.address} sent a reply of {len(parts)} parts")
            try:
                request_id = unpack_request_id(parts[0])
                message = self.decode(parts[1])
            except MalformedMessageError as error:
                raise MalformedMessageError(f"peer {self.address}: {error}") from None
            except Exception as error:
                # Whatever the decoder raised on hostile bytes (RecursionError on deep
                # nesting, ...) is one unreadable reply, not a failure of the caller's loop.
                raise MalformedMessageError(
                    f"peer {self.address} sent an unreadable reply ({len(parts[1])} bytes): "
                    f"{type(error).__name__}: {error}"
                ) from None
            if isinstance(message, Welcome):
                check_welcome(message, peer=f"peer {self.address}")
            out.append((request_id, message))


class ControlClient:
    """Blocking request/reply client with a deadline on every call (used by the trainer).

    A call that times out resets the socket (dropping any late reply) and raises
    `ProtocolTimeoutError` naming the peer and operation; the caller decides to retry.
    `resolve`: the controller's address now (the run's address book), asked before each
    (re)connect and once a second while a call waits, so a controller that moved to another
    node is found there.
    """

    def __init__(
        self,
        address: str,
        *,
        encode: Encoder,
        decode: Decoder,
        timeout_s: float = 10.0,
        client_id: str = "",
        role: str = "",
        context: zmq.Context[Any] | None = None,
        resolve: Callable[[], str] | None = None,
        credential: Credential | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        self.timeout_s = timeout_s
        self.resolve = resolve
        self.credential = credential
        self.context = context or zmq.Context.instance()
        self.link: PeerLink | None = None
        self._args = (address, encode, decode, client_id, role)

    @property
    def peer(self) -> str:
        return f"controller {self._args[0]}"

    def _poll(self, event: int, operation: str, deadline: float, timeout_s: float) -> None:
        """Wait until `deadline` (monotonic) for `event` on the link; missing it resets the
        link and raises (naming `timeout_s`). With `resolve`, the address is looked up every
        `RESOLVE_EVERY_S` meanwhile: a controller that moved ends the wait at once (the next
        call connects there)."""
        assert self.link is not None and self.link.socket is not None
        while True:
            remaining = deadline - time.monotonic()
            wait = min(remaining, RESOLVE_EVERY_S) if self.resolve is not None else remaining
            if remaining > 0 and self.link.socket.poll(int(wait * 1000) + 1, event):
                return
            last = remaining <= wait
            moved = None if last or self.resolve is None else self.resolve()
            if last or (moved is not None and moved != self._args[0]):
                self.reset()
                where = "" if last else f" (the controller moved to {moved})"
                raise ProtocolTimeoutError(self.peer, f"{operation}{where}", timeout_s)

    def _wait(self, request_id: int, operation: str, timeout_s: float) -> Message:
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll(zmq.POLLIN, operation, deadline, timeout_s)
            assert self.link is not None
            for rid, message in self.link.receive():
                if rid == request_id:
                    return message

    def _send(self, message: Message, operation: str, timeout_s: float) -> int:
        self._poll(zmq.POLLOUT, f"send {operation}", time.monotonic() + timeout_s, timeout_s)
        assert self.link is not None
        request_id = self.link.send(message)
        if request_id is None:
            self.reset()
            raise ProtocolTimeoutError(self.peer, f"send {operation}", timeout_s)
        return request_id

    def _connect(self, timeout_s: float) -> None:
        address, encode, decode, client_id, role = self._args
        if self.resolve is not None and (current := self.resolve()) != address:
            address = current
            self._args = (address, encode, decode, client_id, role)
        self.link = PeerLink(
            address,
            encode=encode,
            decode=decode,
            context=self.context,
            client_id=client_id,
            role=role,
            credential=self.credential,
        )
        assert self.link.socket is not None
        hello = Hello(protocol_version=PROTOCOL_VERSION, client_id=self.link.client_id, role=role)
        reply = self._wait(self._send(hello, "Hello", timeout_s), "Hello", timeout_s)
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply.code, reply.message, peer=self.peer)
        if not isinstance(reply, Welcome):
            raise MalformedMessageError(f"{self.peer} answered Hello with {type(reply).__name__}")

    def call(self, message: Message, *, timeout_s: float | None = None) -> Message:
        """Send `message`, return the reply; `ErrorReply` raises `RemoteError`."""
        timeout = timeout_s or self.timeout_s
        if self.link is None:
            self._connect(timeout)
        operation = type(message).__name__
        reply = self._wait(self._send(message, operation, timeout), operation, timeout)
        if isinstance(reply, ErrorReply) and reply.code == "handshake_required":
            # The server restarted (or forgot an idle client): say Hello again, once.
            self.reset()
            self._connect(timeout)
            reply = self._wait(self._send(message, operation, timeout), operation, timeout)
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply.code, reply.message, peer=self.peer)
        return reply

    def reset(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def close(self) -> None:
        self.reset()
