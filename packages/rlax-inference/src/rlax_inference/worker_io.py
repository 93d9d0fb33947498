"""The worker's I/O thread: the only code that touches the worker's ROUTER socket.

It answers `Hello` at once (whatever the engine thread is doing: compiling, reloading,
stepping), decodes each `GenerateRequest` into the inbox the engine thread reads, and sends
what the engine thread posts to the outbox (an inproc PAIR wakes it). It owns the book of
requests in flight: a request beyond `max_inflight`, or beyond its client's
`max_inflight_per_client`, is answered ``busy`` at once (the client retries elsewhere or
later), and the requests of a client whose connection closed are
cancelled (a `Cancel` in the inbox; the engine thread aborts them and frees their blocks).

A closed connection is told by the kernel socket a client's messages came from: every
message carries the file descriptor it was read from (``ZMQ_SRCFD``), and a connection is
gone once that descriptor no longer names the same socket (its inode). ZMTP heartbeats
(``ZMQ_HEARTBEAT_IVL``/``_TIMEOUT``) close a connection whose peer host vanished without
closing it, so that case ends the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

import zmq

import rlax_protocol as rp
from rlax_protocol.auth import Permissions, ServerAuth, roles

__all__ = ["Cancel", "Job", "WorkerIO"]

log = logging.getLogger("rlax.worker")

WORKER_PERMISSIONS: Permissions = {rp.GenerateRequest: roles("controller")}
"""When the run authenticates (`rlax_protocol.auth`) only its controller asks for generations."""

MAX_WORKER_REQUEST_BYTES = 16 * 1024 * 1024
"""Largest frame a worker receives (ZeroMQ drops a sender of a bigger one before buffering
it): a GenerateRequest of a 1M-token prompt is ~5 MB of msgpack."""

_CHECK_CLIENTS_S = 0.2  # how often the connections of clients with requests in flight are checked


@dataclasses.dataclass(frozen=True)
class Job:
    """A decoded request for the engine thread; `key` names it in both threads, `client`
    is the connection it came on (the engine thread's round robin is across clients)."""

    key: int
    request: rp.GenerateRequest
    client: bytes = b""


@dataclasses.dataclass(frozen=True)
class Cancel:
    """The client of request `key` is gone: abort it (no reply is sent)."""

    key: int


@dataclasses.dataclass
class _InFlight:
    identity: bytes
    transport_id: int
    connection: tuple[int, int] | None  # (fd, inode) of the connection it came on; None: unknown (inproc)


class WorkerIO:
    """Owns the ROUTER socket in its own thread; `post()` is the engine thread's way out."""

    def __init__(
        self,
        bind: str,
        *,
        server_id: str,
        max_inflight: int,
        max_inflight_per_client: int | None = None,
        heartbeat_s: float = 2.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight}: must be >= 1")
        self.server_id = server_id
        self.max_inflight = max_inflight
        # One client cannot fill the worker: beyond this many of its own, its next is ``busy``.
        self.max_inflight_per_client = max_inflight_per_client or max_inflight
        self.inbox: queue.Queue[Job | Cancel] = queue.Queue()
        self._outbox: queue.Queue[tuple[int, rp.Message]] = queue.Queue()
        self._inflight: dict[int, _InFlight] = {}
        self._keys = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # Counters (written by the I/O thread only).
        self.num_busy = 0
        self.num_cancelled = 0
        self.num_dropped_replies = 0
        ctx = context or zmq.Context.instance()
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client fails, not vanishes
        if heartbeat_s > 0:
            self.socket.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
            self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 5000))
        self.auth = ServerAuth(server_id, WORKER_PERMISSIONS, max_message_bytes=MAX_WORKER_REQUEST_BYTES)
        self._context = ctx
        try:
            self.auth.secure(ctx, self.socket, bind)
            self.socket.bind(bind)
        except BaseException:
            self.socket.close(linger=0)
            self.auth.close()
            raise
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        wake = f"inproc://rlax-worker-wake-{id(self):x}-{os.getpid()}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.linger = 0
        self._wake_rx.bind(wake)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.linger = 0
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()

    # -- the engine thread's side ----------------------------------------------------------
    def post(self, key: int, message: rp.Message) -> None:
        """Answer request `key` (dropped if its client is gone); wakes the I/O thread."""
        self._outbox.put((key, message))
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the I/O thread has wake-ups waiting already

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rlax-worker-io", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._thread is None or not self._thread.is_alive():
            for socket in (self.socket, self._wake_rx, self._wake_tx):
                socket.close(linger=0)
            self.auth.close()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # a dead I/O thread must stop the worker, loudly
            log.exception("the worker's I/O thread failed")
            self.error = error
            self._stop.set()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_check = time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            self._send_outbox()
            if self.socket in events:
                for _ in range(1000):  # then the outbox again: replies never wait behind a flood
                    try:
                        parts = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._serve_one(parts)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_CLIENTS_S
                self._cancel_disconnected()

    # -- requests --------------------------------------------------------------------------
    def _serve_one(self, parts: list[zmq.Frame]) -> None:
        """One message: whatever makes it fail is answered with an `ErrorReply` (where the
        sender is known) and logged; the I/O thread, and so the worker, keeps serving."""
        try:
            self._handle(parts)
        except Exception as error:
            log.exception("error handling a request")
            if parts:
                reply = rp.ErrorReply(code="internal", message=f"{type(error).__name__}: {error}")
                self._send(parts[0].bytes, 0, reply)

    def _handle(self, parts: list[zmq.Frame]) -> None:
        request = rp.parse_request(parts)
        message = request.message
        reply: rp.Message
        if request.error is not None or message is None:
            reply = rp.ErrorReply(code="malformed", message=str(request.error))
        elif isinstance(message, rp.Hello):
            reply = rp.welcome_for(message, server_id=self.server_id)
        elif (refused := self.auth.refusal(ServerAuth.role_of(parts[-1]), message)) is not None:
            reply = refused
        elif isinstance(message, rp.GenerateRequest):
            if len(self._inflight) >= self.max_inflight:
                self.num_busy += 1
                reply = rp.ErrorReply(
                    code="busy",
                    message=f"{message.request_id}: the worker has {len(self._inflight)} requests in flight "
                    f"(workers.max_inflight_requests={self.max_inflight}); retry elsewhere or later",
                )
            elif (mine := self._client_inflight(request.identity)) >= self.max_inflight_per_client:
                self.num_busy += 1
                reply = rp.ErrorReply(
                    code="busy",
                    message=f"{message.request_id}: this client has {mine} requests in flight "
                    f"(the worker's max_inflight_per_client={self.max_inflight_per_client}); retry later",
                )
            else:
                key = next(self._keys)
                self._inflight[key] = _InFlight(request.identity, request.request_id, _connection(parts[-1]))
                self.inbox.put(Job(key, message, request.identity))
                return  # answered when the engine thread posts its result
        else:
            name = type(message).__name__
            reply = rp.ErrorReply(
                code="unknown_message", message=f"{name} is not an inference-worker request"
            )
        self._send(request.identity, request.request_id, reply)

    def _client_inflight(self, identity: bytes) -> int:
        return sum(1 for entry in self._inflight.values() if entry.identity == identity)

    def _send_outbox(self) -> None:
        while True:
            try:
                key, message = self._outbox.get_nowait()
            except queue.Empty:
                return
            entry = self._inflight.pop(key, None)
            if entry is not None:  # None: cancelled, its client is gone
                self._send(entry.identity, entry.transport_id, message)

    def _send(self, identity: bytes, transport_id: int, message: rp.Message) -> None:
        try:
            self.socket.send_multipart(rp.reply_parts(identity, transport_id, message), zmq.NOBLOCK)
        except zmq.ZMQError as error:  # Again: the client's queue is full; EHOSTUNREACH: it is gone
            self.num_dropped_replies += 1
            log.warning(
                "could not deliver %s to client %s: %s", type(message).__name__, identity.hex(), error
            )

    # -- clients that went away --------------------------------------------------------------
    def _cancel_disconnected(self) -> None:
        alive: dict[tuple[int, int], bool] = {}
        for key, entry in list(self._inflight.items()):
            connection = entry.connection
            if connection is None:
                continue
            if connection not in alive:
                alive[connection] = _connection_open(connection)
            if not alive[connection]:
                del self._inflight[key]
                self.num_cancelled += 1
                self.inbox.put(Cancel(key))
                log.info("client %s disconnected: its request %d is cancelled", entry.identity.hex(), key)


def _connection(frame: zmq.Frame) -> tuple[int, int] | None:
    """(fd, inode) of the kernel socket `frame` was read from; None where there is none."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    if not isinstance(fd, int) or fd < 0:
        return None
    try:
        return fd, os.fstat(fd).st_ino
    except OSError:
        return fd, -1  # closed already: the client is gone


def _connection_open(connection: tuple[int, int]) -> bool:
    fd, inode = connection
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False
