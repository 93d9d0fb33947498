"""The parameter server: one ROUTER socket, a broker thread, worker threads, a persister.

Threads and sockets::

    clients ──tcp──► ROUTER (broker thread) ──inproc ROUTER──► worker DEALERs (N threads)
                                             ◄── replies ─────  persister DEALER (1 thread)

The broker hands each request to an idle worker only (load balancing), so a worker
busy verifying a large commit never delays a pull queued behind it. Workers answer
with ``REPLY`` (and become idle again) or ``SEND`` (an extra message, e.g. waking a
long-poll). Byte payloads move as `zmq.Frame`s without copies end to end.

Durability (with a state dir): a committed version becomes visible only after it is
on disk. The worker verifies the push and hands it to the persister, which writes
the file (fsynced, renamed; then files older than the newest `keep` are removed),
installs the version, wakes long-polls and answers the commit. So every version a
puller ever saw survives a ``kill -9``, a restart never serves an older version than
one already served, and it serves the same newest `keep` versions again (pinned
pulls of an older version keep working). A write that fails answers
the commit with ``persist_failed`` and the version never becomes visible; the
persister lives on. Without a state dir a commit is visible at once.

A pusher on this host (`PushBegin.local`) is given a staging file in the state dir
instead: it writes the tensors there, and on commit the persister hashes the file
against the manifest and renames it into place. The weights cross no socket and the
server never holds them in anonymous memory (`persist.create_staging`).

The parts: `broker` forwards, `pull_path` and `push_path` answer the pullers and
pushers, `persister` makes commits durable; this module starts and stops the threads
and runs the workers.

No message can stop a thread: a worker answers anything one request raises with an
``internal`` error and goes back to the idle pool.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import zmq

from rlax_paramserver.broker import POLL_MS, WORKER_READY, WORKER_REPLY, forward_until_stopped, send_wakeups
from rlax_paramserver.config import ServerConfig
from rlax_paramserver.long_polls import Wakeup
from rlax_paramserver.persist import load_states, spill_states, unspill_states
from rlax_paramserver.persister import Persister
from rlax_paramserver.pull_path import PullPath
from rlax_paramserver.push_path import PushPath
from rlax_paramserver.store import StoredVersion, StoreError, VersionStore, Waiter
from rlax_protocol import (
    Committed,
    ErrorReply,
    FetchChunks,
    LatestQuery,
    LatestVersion,
    Message,
    PeerRegistry,
    PullBegin,
    PullEnd,
    PushAbort,
    PushBegin,
    PushChunks,
    PushCommit,
    Request,
    ServerStats,
    StatQuery,
    WaitNewer,
    encode,
    parse_request,
    start_curve_server,
)
from rlax_protocol.auth import ANY_ROLE, InsecureBindError, Permissions, ServerAuth, roles
from rlax_protocol.transport import pack_request_id

log = logging.getLogger(__name__)

PARAMSERVER_PERMISSIONS: Permissions = {
    PushBegin: roles("trainer"),
    PushChunks: roles("trainer"),
    PushCommit: roles("trainer"),
    PushAbort: roles("trainer"),
    PullBegin: roles("trainer", "worker"),
    FetchChunks: roles("trainer", "worker"),
    PullEnd: roles("trainer", "worker"),
    LatestQuery: roles(ANY_ROLE),
    WaitNewer: roles(ANY_ROLE),
    StatQuery: roles(ANY_ROLE),
}
"""Who may send what when the run authenticates (`rlax_protocol.auth`): only the trainer
pushes (so only it holds push slots), the trainer and workers pull, anyone of the run asks."""


class ParamServer:
    """Serve weight versions on `config.bind` until `stop()`; usable as a context manager.

    `start()` loads the newest `config.keep` persisted versions (the valid ones that
    `config.state_dir` holds), binds, starts the threads and returns the bound address (useful with
    ``tcp://127.0.0.1:*``).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = VersionStore(config)
        self.persister = Persister(self.store, config) if config.state_dir is not None else None
        self.pulls = PullPath(self.store, config)
        self.pushes = PushPath(self.store, config, self.persister)
        self.peers = PeerRegistry(idle_timeout_s=config.client_idle_timeout_s, max_peers=config.max_clients)
        # A peer sending a frame larger than max_frame_bytes is dropped by ZeroMQ itself.
        self.auth = ServerAuth(
            config.server_id,
            PARAMSERVER_PERMISSIONS,
            insecure=True if config.curve is not None else config.insecure,
            max_message_bytes=config.max_frame_bytes + 4096,
        )
        if config.curve is not None:
            self.auth.credential = None  # the explicit CURVE allow-list authenticates instead
        self.address = ""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._context: zmq.Context[Any] | None = None
        self._backend_address = f"inproc://rlax-paramserver-{uuid.uuid4().hex}"
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._serving = False  # started: a stop then moves the versions to config.rest_dir

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        if self.config.state_dir is not None and self.config.rest_dir is not None:
            copied = unspill_states(self.config.rest_dir, self.config.state_dir, self.config.keep)
            if copied:
                log.info(
                    "versions %s copied from %s into %s", copied, self.config.rest_dir, self.config.state_dir
                )
        if self.config.state_dir is not None:
            self._restore()
        self._serving = True
        self._context = zmq.Context(io_threads=self.config.io_threads)
        broker = threading.Thread(target=self._broker, name="paramserver-broker", daemon=True)
        broker.start()
        self._threads.append(broker)
        if not self._ready.wait(30) or self._start_error is not None:
            self.stop()
            if isinstance(self._start_error, InsecureBindError):
                raise self._start_error
            raise RuntimeError(f"parameter server failed to bind {self.config.bind}: {self._start_error}")
        for i in range(self.config.workers):
            thread = threading.Thread(
                target=self._worker, args=(i,), name=f"paramserver-worker-{i}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        if self.config.state_dir is not None:
            assert self.persister is not None
            persister = threading.Thread(
                target=self.persister.run,
                args=(self._context, self._backend_address, self._stop),
                name="paramserver-persister",
                daemon=True,
            )
            persister.start()
            self._threads.append(persister)
        log.info("rlax-paramserver serving on %s (keep=%d)", self.address, self.config.keep)
        return self.address

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        self._threads.clear()
        self.store.drop_all_pushes()
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._serving and self.config.state_dir is not None and self.config.rest_dir is not None:
            self._serving = False
            copied = spill_states(
                self.config.state_dir, self.config.rest_dir, self.config.keep, fsync=self.config.fsync
            )
            log.info(
                "versions %s copied to %s; %s cleared", copied, self.config.rest_dir, self.config.state_dir
            )

    def __enter__(self) -> ParamServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _restore(self) -> None:
        assert self.config.state_dir is not None
        states, error = load_states(self.config.state_dir, self.config.keep, owner=True)
        self.store.state_error = error
        for loaded in states:  # oldest first: each install is newer than the last
            stored = StoredVersion(
                loaded.version,
                loaded.manifest,
                loaded.metadata,
                loaded.frames,
                loaded.manifest.total_bytes,
                path=loaded.path,
            )
            try:
                self.store.install(stored)
            except StoreError as err:  # e.g. adapters whose base file was corrupt: never served
                log.error("version %d from %s is not served: %s", loaded.version, loaded.path, err)
                self.store.state_error = "; ".join(filter(None, [self.store.state_error, str(err)]))
                continue
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
            self.auth.secure(self._context, frontend, self.config.bind)
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
            self.auth.close()
            return
        self._ready.set()
        try:
            forward_until_stopped(frontend, backend, self._stop)
        finally:
            frontend.close(0)
            backend.close(0)
            if auth is not None:
                auth.stop()
            self.auth.close()

    # ------------------------------------------------------------------ workers

    def _worker(self, index: int) -> None:
        assert self._context is not None
        socket = self._context.socket(zmq.DEALER)
        socket.linger = 0
        socket.identity = f"worker-{index}".encode()
        socket.connect(self._backend_address)
        socket.send(WORKER_READY)
        next_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_sweep:
                    try:
                        send_wakeups(socket, self.store.sweep())
                    except Exception:  # keep serving; the next sweep retries
                        log.exception("worker %d: sweeping leases and long-polls failed", index)
                    next_sweep = time.monotonic() + POLL_MS / 1000
                if not socket.poll(POLL_MS):
                    continue
                self._serve_one(socket, socket.recv_multipart(copy=False))
        finally:
            socket.close(0)

    def _serve_one(self, socket: zmq.Socket[Any], parts: list[zmq.Frame]) -> None:
        """Answer one request and return to the idle pool, whatever the request did.

        The broker counts this worker idle again only after ``REPLY`` or ``READY``, so
        exactly one of them is sent on every path (else the worker is lost for good).
        """
        role = parts[0].bytes.decode("utf-8", "replace") if parts else ""
        request = parse_request(parts[1:])
        try:
            answer = self._answer(socket, request, role)
        except Exception as err:  # `_answer` catches what handlers raise; this is the last guard
            log.exception("internal error answering a request")
            answer = ErrorReply(code="internal", message=f"{type(err).__name__}: {err}"), []
        if answer is None:
            socket.send(WORKER_READY)
        else:
            message, frames = answer
            head = [WORKER_REPLY, request.identity, pack_request_id(request.request_id)]
            try:
                socket.send_multipart([*head, encode(message), *frames], copy=False)
            except (zmq.ZMQError, TypeError, ValueError) as err:
                log.error("could not send a reply: %s", err)
                error = ErrorReply(code="internal", message=f"reply could not be sent: {err}")
                try:
                    socket.send_multipart([*head, encode(error)])
                except zmq.ZMQError:
                    socket.send(WORKER_READY)  # no answer possible, but stay in the idle pool
        try:
            self.store.reap()
        except Exception:
            log.exception("freeing evicted versions failed")

    def _answer(
        self, socket: zmq.Socket[Any], request: Request, role: str = ""
    ) -> tuple[Message, list[Any]] | None:
        """The reply to one request, or None when it is answered later (long-poll, persisting commit)."""
        message = request.message
        if request.error is not None or message is None:
            self.store.count_malformed()
            return ErrorReply(code="malformed", message=str(request.error)), []
        try:
            screened = self.peers.screen(
                request.identity, message, server_id=self.config.server_id, auth=self.auth, role=role
            )
            if screened is not None:
                return screened, []
            return self._dispatch(socket, request, message)
        except StoreError as err:
            if err.code == "malformed":
                self.store.count_malformed()
            return ErrorReply(code=err.code, message=str(err)), []
        except Exception as err:  # keep serving whatever one request did
            log.exception("internal error answering %s", type(message).__name__)
            return ErrorReply(code="internal", message=f"{type(err).__name__}: {err}"), []

    @staticmethod
    def _committed(
        socket: zmq.Socket[Any], committed: tuple[Committed, list[Wakeup]] | None
    ) -> tuple[Message, list[Any]] | None:
        """A commit's reply, its long-polls woken; None when the persister answers it once
        the version is on disk."""
        if committed is None:
            return None
        reply, wakeups = committed
        send_wakeups(socket, wakeups)
        return reply, []

    def _dispatch(
        self, socket: zmq.Socket[Any], request: Request, message: Message
    ) -> tuple[Message, list[Any]] | None:
        if isinstance(message, PullBegin):
            return self.pulls.begin(message, self.peers.client_key(request.identity))
        if isinstance(message, FetchChunks):
            return self.pulls.fetch(message)
        if isinstance(message, PullEnd):
            return self.pulls.end(message), []
        if isinstance(message, PushBegin) and message.whole:
            committed = self.pushes.whole(request, message, self.peers.client_key(request.identity))
            return self._committed(socket, committed)
        if isinstance(message, PushBegin | PushCommit | PullBegin | PullEnd) and request.frames:
            raise StoreError(
                "malformed", f"{type(message).__name__} takes no frames, got {len(request.frames)}"
            )
        if isinstance(message, PushBegin):
            return self.pushes.begin(message, self.peers.client_key(request.identity)), []
        if isinstance(message, PushChunks):
            return self.pushes.chunks(message, request.frames), []
        if isinstance(message, PushCommit):
            return self._committed(socket, self.pushes.commit(request, message))
        if isinstance(message, PushAbort):
            return self.pushes.abort(message), []
        if isinstance(message, LatestQuery):
            return LatestVersion(version=self.store.latest), []
        if isinstance(message, WaitNewer):
            result = self.store.wait_newer(
                request.identity,
                request.request_id,
                message.version,
                max(0, message.timeout_ms) / 1000,
                self.peers.client_key(request.identity),
            )
            return None if isinstance(result, Waiter) else (LatestVersion(version=result), [])
        if isinstance(message, StatQuery):
            return ServerStats(clients=self.peers.count(), **self.store.snapshot()), []
        return ErrorReply(
            code="unknown_message", message=f"{type(message).__name__} is not a parameter-server request"
        ), []
