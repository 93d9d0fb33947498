"""The parameter server: one ROUTER socket, a broker thread, worker threads, a persister.

Threads and sockets::

    clients ──tcp──► ROUTER (broker thread) ──inproc ROUTER──► worker DEALERs (N threads)
                                             ◄── replies ─────  persister DEALER (1 thread)

The broker hands each request to an idle worker only (load balancing), so a worker
busy verifying a large commit never delays a pull queued behind it. Workers answer
with ``REPLY`` (and become idle again) or ``SEND`` (an extra message, e.g. waking a
long-poll); the persister writes the newest version to disk and then sends the
commit's reply. Byte payloads move as `zmq.Frame`s without copies end to end.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.persist import load_newest, write_state
from rlax_paramserver.store import StoredVersion, StoreError, VersionStore, Waiter, Wakeup
from rlax_protocol import (
    Ack,
    Committed,
    ErrorReply,
    FetchChunks,
    Hello,
    LatestQuery,
    LatestVersion,
    Message,
    NotNewer,
    PeerRegistry,
    PullBegin,
    PullEnd,
    PullGranted,
    PushAbort,
    PushBegin,
    PushChunks,
    PushCommit,
    PushReady,
    Request,
    ServerStats,
    StatQuery,
    WaitNewer,
    Welcome,
    encode,
    parse_request,
    start_curve_server,
    welcome_for,
)
from rlax_protocol.messages import Chunks
from rlax_protocol.transport import pack_request_id

log = logging.getLogger(__name__)

_READY, _REPLY, _SEND = b"R", b"P", b"S"
_POLL_MS = 50


@dataclass
class _PersistJob:
    identity: bytes
    request_id: int
    stored: StoredVersion


class ParamServer:
    """Serve weight versions on `config.bind` until `stop()`; usable as a context manager.

    `start()` loads the persisted newest version (if `config.state_dir` holds a valid
    one), binds, starts the threads and returns the bound address (useful with
    ``tcp://127.0.0.1:*``).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = VersionStore(config)
        self.peers = PeerRegistry(idle_timeout_s=config.client_idle_timeout_s)
        self.address = ""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._context: zmq.Context[Any] | None = None
        self._backend_address = f"inproc://rlax-paramserver-{uuid.uuid4().hex}"
        self._persist_jobs: queue.Queue[_PersistJob] = queue.Queue()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        if self.config.state_dir is not None:
            self._restore()
        self._context = zmq.Context(io_threads=self.config.io_threads)
        broker = threading.Thread(target=self._broker, name="paramserver-broker", daemon=True)
        broker.start()
        self._threads.append(broker)
        if not self._ready.wait(30) or self._start_error is not None:
            self.stop()
            raise RuntimeError(f"parameter server failed to bind {self.config.bind}: {self._start_error}")
        for i in range(self.config.workers):
            thread = threading.Thread(
                target=self._worker, args=(i,), name=f"paramserver-worker-{i}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        if self.config.state_dir is not None:
            persister = threading.Thread(target=self._persister, name="paramserver-persister", daemon=True)
            persister.start()
            self._threads.append(persister)
        log.info("rlax-paramserver serving on %s (keep=%d)", self.address, self.config.keep)
        return self.address

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        self._threads.clear()
        if self._context is not None:
            self._context.term()
            self._context = None

    def __enter__(self) -> ParamServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _restore(self) -> None:
        assert self.config.state_dir is not None
        loaded, error = load_newest(self.config.state_dir)
        self.store.state_error = error
        if loaded is not None:
            stored = StoredVersion(
                loaded.version, loaded.manifest, loaded.metadata, loaded.frames, loaded.manifest.total_bytes
            )
            self.store.install(stored)
            self.store.persisted_version = loaded.version
            log.info("restored version %d from %s", loaded.version, loaded.path)

    # ------------------------------------------------------------------ broker

    def _broker(self) -> None:
        assert self._context is not None
        frontend = self._context.socket(zmq.ROUTER)
        backend = self._context.socket(zmq.ROUTER)
        auth = None
        try:
            frontend.linger = 0
            backend.linger = 0
            # A peer sending a frame larger than this is disconnected by ZeroMQ itself.
            frontend.maxmsgsize = self.config.max_frame_bytes + 4096
            if self.config.curve is not None:
                auth = start_curve_server(self._context, frontend, self.config.curve)
            frontend.bind(self.config.bind)
            backend.bind(self._backend_address)
            self.address = frontend.last_endpoint.decode()
        except BaseException as err:  # report to start() instead of dying silently
            self._start_error = err
            self._ready.set()
            frontend.close(0)
            backend.close(0)
            if auth is not None:
                auth.stop()
            return
        self._ready.set()
        idle: collections.deque[bytes] = collections.deque()
        poller = zmq.Poller()
        poller.register(backend, zmq.POLLIN)
        poller.register(frontend, 0)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if backend in events:
                    while True:
                        try:
                            parts = backend.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        worker, kind = parts[0].bytes, parts[1].bytes
                        if kind in (_REPLY, _SEND) and len(parts) > 2:
                            frontend.send_multipart(parts[2:], copy=False)
                        if kind in (_READY, _REPLY):
                            idle.append(worker)
                if frontend in events:
                    while idle:
                        try:
                            parts = frontend.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        backend.send_multipart([idle.popleft(), *parts], copy=False)
                poller.modify(frontend, zmq.POLLIN if idle else 0)
        finally:
            frontend.close(0)
            backend.close(0)
            if auth is not None:
                auth.stop()

    # ------------------------------------------------------------------ workers

    def _worker(self, index: int) -> None:
        assert self._context is not None
        socket = self._context.socket(zmq.DEALER)
        socket.linger = 0
        socket.identity = f"worker-{index}".encode()
        socket.connect(self._backend_address)
        socket.send(_READY)
        next_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_sweep:
                    self._send_wakeups(socket, self.store.sweep())
                    next_sweep = time.monotonic() + _POLL_MS / 1000
                if not socket.poll(_POLL_MS):
                    continue
                request = parse_request(socket.recv_multipart(copy=False))
                answer = self._answer(socket, request)
                if answer is None:
                    socket.send(_READY)
                else:
                    message, frames = answer
                    socket.send_multipart(
                        [
                            _REPLY,
                            request.identity,
                            pack_request_id(request.request_id),
                            encode(message),
                            *frames,
                        ],
                        copy=False,
                    )
                self.store.reap()
        finally:
            socket.close(0)

    def _send_wakeups(self, socket: zmq.Socket[Any], wakeups: list[Wakeup]) -> None:
        for w in wakeups:
            socket.send_multipart(
                [_SEND, w.identity, pack_request_id(w.request_id), encode(LatestVersion(version=w.latest))]
            )

    def _answer(self, socket: zmq.Socket[Any], request: Request) -> tuple[Message, list[Any]] | None:
        """The reply to one request, or None when it is answered later (long-poll, persisting commit)."""
        message = request.message
        if request.error is not None or message is None:
            self.store.count_malformed()
            return ErrorReply(code="malformed", message=str(request.error)), []
        try:
            if isinstance(message, Hello):
                welcome: Welcome = welcome_for(message, server_id=self.config.server_id)
                if welcome.accepted:
                    self.peers.admit(request.identity)
                return welcome, []
            if not self.peers.touch(request.identity):
                return ErrorReply(
                    code="handshake_required", message="say Hello (with the protocol version) first"
                ), []
            return self._dispatch(socket, request, message)
        except StoreError as err:
            if err.code == "malformed":
                self.store.count_malformed()
            return ErrorReply(code=err.code, message=str(err)), []
        except Exception as err:  # keep serving whatever one request did
            log.exception("internal error answering %s", type(message).__name__)
            return ErrorReply(code="internal", message=f"{type(err).__name__}: {err}"), []

    def _dispatch(
        self, socket: zmq.Socket[Any], request: Request, message: Message
    ) -> tuple[Message, list[Any]] | None:
        store = self.store
        if isinstance(message, PullBegin):
            granted = store.begin_pull(message.version, message.if_newer_than)
            if granted is None or isinstance(granted, int):
                return NotNewer(latest=granted), []
            lease, stored = granted
            frames: list[Any] = []
            if message.prefetch_bytes > 0 or not stored.frames:
                frames = store.prefetch(
                    lease, stored, min(message.prefetch_bytes, self.config.max_message_bytes)
                )
            grant = PullGranted(
                lease.lease_id,
                stored.version,
                stored.manifest,
                stored.metadata,
                self.config.lease_ttl_s,
                first_frames=len(frames),
            )
            return grant, frames
        if isinstance(message, FetchChunks):
            frames = store.fetch(message.lease_id, message.first_frame, message.count)
            return Chunks(message.lease_id, message.first_frame, message.count), frames
        if isinstance(message, PullEnd):
            store.end_pull(message.lease_id)
            return Ack(), []
        if isinstance(message, PushBegin):
            push_id = store.begin_push(message.version, message.manifest, message.metadata, request.identity)
            return PushReady(push_id=push_id, max_message_bytes=self.config.max_message_bytes), []
        if isinstance(message, PushChunks):
            if message.count != len(request.frames):
                raise StoreError(
                    "malformed", f"PushChunks says {message.count} frames, {len(request.frames)} attached"
                )
            total = sum(f.buffer.nbytes for f in request.frames)
            if len(request.frames) > 1 and total > self.config.max_message_bytes:
                raise StoreError(
                    "too_large",
                    f"{total} bytes in one message exceed max_message_bytes={self.config.max_message_bytes}",
                )
            checks = store.put_chunks(
                message.push_id, message.first_frame, [f.buffer for f in request.frames]
            )
            for check in checks:
                store.record_check(check, store.hash_frames(check.frames))
            return Ack(), []
        if isinstance(message, PushCommit):
            push = store.take_for_commit(message.push_id)
            store.verify(push)
            stored, wakeups = store.commit(push)
            self._send_wakeups(socket, wakeups)
            log.info(
                "committed version %d (%d tensors, %d bytes)",
                stored.version,
                len(stored.manifest.tensors),
                stored.nbytes,
            )
            if self.config.state_dir is None:
                return Committed(version=stored.version, persisted=False), []
            self._persist_jobs.put(_PersistJob(request.identity, request.request_id, stored))
            return None
        if isinstance(message, PushAbort):
            store.abort_push(message.push_id)
            return Ack(), []
        if isinstance(message, LatestQuery):
            return LatestVersion(version=store.latest), []
        if isinstance(message, WaitNewer):
            result = store.wait_newer(
                request.identity, request.request_id, message.version, max(0, message.timeout_ms) / 1000
            )
            return None if isinstance(result, Waiter) else (LatestVersion(version=result), [])
        if isinstance(message, StatQuery):
            return ServerStats(clients=self.peers.count(), **store.snapshot()), []
        return ErrorReply(
            code="unknown_message", message=f"{type(message).__name__} is not a parameter-server request"
        ), []

    # ------------------------------------------------------------------ persister

    def _persister(self) -> None:
        assert self._context is not None and self.config.state_dir is not None
        socket = self._context.socket(zmq.DEALER)
        socket.linger = 0
        socket.identity = b"persister"
        socket.connect(self._backend_address)
        try:
            while not self._stop.is_set():
                try:
                    job = self._persist_jobs.get(timeout=_POLL_MS / 1000)
                except queue.Empty:
                    continue
                persisted = False
                stored = job.stored
                if stored.version == self.store.latest:  # a newer commit supersedes this write
                    try:
                        write_state(
                            self.config.state_dir,
                            stored.version,
                            stored.manifest,
                            stored.metadata,
                            stored.frames,
                        )
                        persisted = True
                        self.store.persisted_version = stored.version
                        self.store.state_error = None
                    except OSError as err:
                        log.error("could not persist version %d: %s", stored.version, err)
                        self.store.state_error = f"persisting version {stored.version} failed: {err}"
                reply = Committed(version=stored.version, persisted=persisted)
                socket.send_multipart([_SEND, job.identity, pack_request_id(job.request_id), encode(reply)])
        finally:
            socket.close(0)
