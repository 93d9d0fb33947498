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

No message can stop a thread: a worker answers anything one request raises with an
``internal`` error and goes back to the idle pool.
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

import msgspec
import zmq

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.persist import (
    CorruptStateError,
    create_staging,
    discard_staging,
    install_staged,
    load_states,
    map_state,
    spill_states,
    unspill_states,
    write_state,
)
from rlax_paramserver.store import PendingPush, StoredVersion, StoreError, VersionStore, Waiter, Wakeup
from rlax_protocol import (
    Ack,
    Committed,
    ErrorReply,
    FetchChunks,
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
    encode,
    parse_request,
    start_curve_server,
)
from rlax_protocol.auth import ANY_ROLE, InsecureBindError, Permissions, ServerAuth, roles
from rlax_protocol.messages import Chunks
from rlax_protocol.transport import pack_request_id

log = logging.getLogger(__name__)

_READY, _REPLY, _SEND = b"R", b"P", b"S"
_POLL_MS = 50

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


@dataclass
class _PersistJob:
    identity: bytes
    request_id: int
    push: PendingPush


class ParamServer:
    """Serve weight versions on `config.bind` until `stop()`; usable as a context manager.

    `start()` loads the newest `config.keep` persisted versions (the valid ones that
    `config.state_dir` holds), binds, starts the threads and returns the bound address (useful with
    ``tcp://127.0.0.1:*``).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = VersionStore(config)
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
        self._persist_jobs: queue.Queue[_PersistJob] = queue.Queue()
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
                            try:
                                frontend.send_multipart(parts[2:], copy=False)
                            except zmq.ZMQError as err:  # one undeliverable reply must not stop the broker
                                log.error("could not forward a reply: %s", err)
                        if kind in (_READY, _REPLY):
                            idle.append(worker)
                if frontend in events:
                    while idle:
                        try:
                            parts = frontend.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        # The connection's authenticated role goes along (a forwarded frame loses it).
                        role = ServerAuth.role_of(parts[1]).encode() if len(parts) > 1 else b""
                        backend.send_multipart([idle.popleft(), role, *parts], copy=False)
                poller.modify(frontend, zmq.POLLIN if idle else 0)
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
        socket.send(_READY)
        next_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_sweep:
                    try:
                        self._send_wakeups(socket, self.store.sweep())
                    except Exception:  # keep serving; the next sweep retries
                        log.exception("worker %d: sweeping leases and long-polls failed", index)
                    next_sweep = time.monotonic() + _POLL_MS / 1000
                if not socket.poll(_POLL_MS):
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
            socket.send(_READY)
        else:
            message, frames = answer
            head = [_REPLY, request.identity, pack_request_id(request.request_id)]
            try:
                socket.send_multipart([*head, encode(message), *frames], copy=False)
            except (zmq.ZMQError, TypeError, ValueError) as err:
                log.error("could not send a reply: %s", err)
                error = ErrorReply(code="internal", message=f"reply could not be sent: {err}")
                try:
                    socket.send_multipart([*head, encode(error)])
                except zmq.ZMQError:
                    socket.send(_READY)  # no answer possible, but stay in the idle pool
        try:
            self.store.reap()
        except Exception:
            log.exception("freeing evicted versions failed")

    def _send_wakeups(self, socket: zmq.Socket[Any], wakeups: list[Wakeup]) -> None:
        for w in wakeups:
            socket.send_multipart(
                [_SEND, w.identity, pack_request_id(w.request_id), encode(LatestVersion(version=w.latest))]
            )

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

    def _dispatch(
        self, socket: zmq.Socket[Any], request: Request, message: Message
    ) -> tuple[Message, list[Any]] | None:
        store = self.store
        if isinstance(message, PullBegin):
            granted = store.begin_pull(
                message.version, message.if_newer_than, self.peers.client_key(request.identity)
            )
            if granted is None or isinstance(granted, int):
                return NotNewer(latest=granted), []
            lease, stored = granted
            frames: list[Any] = []
            state_file = str(stored.path) if message.local and stored.path is not None else ""
            if (message.prefetch_bytes > 0 and not state_file) or not stored.frames:
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
                state_file=state_file,
            )
            return grant, frames
        if isinstance(message, FetchChunks):
            frames = store.fetch(message.lease_id, message.first_frame, message.count)
            return Chunks(message.lease_id, message.first_frame, message.count), frames
        if isinstance(message, PullEnd):
            store.end_pull(message.lease_id)
            return Ack(), []
        if isinstance(message, PushBegin):
            # Keyed on the client, not the connection: a pusher that reconnects and starts
            # over abandons its older pushes instead of piling them up to `busy`.
            owner = self.peers.client_key(request.identity)
            push_id = store.begin_push(message.version, message.manifest, message.metadata, owner)
            ready = PushReady(push_id=push_id, max_message_bytes=self.config.max_message_bytes)
            if message.local and self.config.state_dir is not None:
                return self._staged(ready, message), []
            return ready, []
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
            try:
                store.verify(push)
            except BaseException:
                store.release(push.version)
                raise
            if self.config.state_dir is not None:
                # Visible only once on disk: the persister installs it and answers.
                self._persist_jobs.put(_PersistJob(request.identity, request.request_id, push))
                return None
            stored, wakeups = store.commit(push)
            self._send_wakeups(socket, wakeups)
            self._log_commit(stored, persisted=False)
            return Committed(version=stored.version, persisted=False), []
        if isinstance(message, PushAbort):
            store.abort_push(message.push_id)
            return Ack(), []
        if isinstance(message, LatestQuery):
            return LatestVersion(version=store.latest), []
        if isinstance(message, WaitNewer):
            result = store.wait_newer(
                request.identity,
                request.request_id,
                message.version,
                max(0, message.timeout_ms) / 1000,
                self.peers.client_key(request.identity),
            )
            return None if isinstance(result, Waiter) else (LatestVersion(version=result), [])
        if isinstance(message, StatQuery):
            return ServerStats(clients=self.peers.count(), **store.snapshot()), []
        return ErrorReply(
            code="unknown_message", message=f"{type(message).__name__} is not a parameter-server request"
        ), []

    def _staged(self, ready: PushReady, message: PushBegin) -> PushReady:
        """`ready` naming a fresh staging file for a pusher on this host; `ready` as it is
        (frames over the socket) when the file cannot be made."""
        assert self.config.state_dir is not None
        try:
            staging = create_staging(
                self.config.state_dir, message.version, message.manifest, message.metadata
            )
        except (OSError, TypeError, ValueError, msgspec.EncodeError) as err:
            log.warning("push of version %d goes over the socket: no staging file: %s", message.version, err)
            return ready
        self.store.stage(ready.push_id, staging)
        return msgspec.structs.replace(ready, staging_file=str(staging.path), data_offset=staging.data_offset)

    @staticmethod
    def _log_commit(stored: StoredVersion, *, persisted: bool) -> None:
        log.info(
            "committed version %d (%d tensors, %d bytes%s)",
            stored.version,
            len(stored.manifest.tensors),
            stored.nbytes,
            ", on disk" if persisted else "",
        )

    # ------------------------------------------------------------------ persister

    def _persister(self) -> None:
        assert self._context is not None
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
                try:
                    reply = self._persist_and_install(socket, job.push)
                except Exception as err:  # the last guard: this thread must outlive any commit
                    log.exception("committing version %d failed", job.push.version)
                    self.store.release(job.push.version)
                    reply = ErrorReply(code="internal", message=f"{type(err).__name__}: {err}")
                # The received frames (the version's size in memory) are not needed any more,
                # whatever the outcome: free them before the pusher hears back and pushes again.
                job.push.frames.clear()
                try:
                    socket.send_multipart(
                        [_SEND, job.identity, pack_request_id(job.request_id), encode(reply)]
                    )
                except zmq.ZMQError as err:
                    log.error("could not answer the commit of version %d: %s", job.push.version, err)
                del job
        finally:
            socket.close(0)

    def _persist_and_install(self, socket: zmq.Socket[Any], push: PendingPush) -> Message:
        """Write `push` to disk, then make it visible; any failure is the pusher's answer.

        Whatever goes wrong (a full disk, an unwritable directory, metadata that cannot be
        encoded, ...) is reported to the pusher as ``persist_failed`` and the version is
        released unseen; the thread goes on with the next commit.
        """
        assert self.config.state_dir is not None
        try:
            if push.staging is not None:
                stored = self._install_staged(push)
            else:
                stored = self._write_and_map(push)
        except Exception as err:
            self.store.release(push.version)
            if push.staging is not None:
                discard_staging(push.staging)
            code = "checksum" if isinstance(err, CorruptStateError) else "persist_failed"
            log.error("could not persist version %d: %s: %s", push.version, type(err).__name__, err)
            self.store.state_error = f"persisting version {push.version} failed: {type(err).__name__}: {err}"
            return ErrorReply(
                code=code,
                message=f"version {push.version} was not committed: {type(err).__name__}: {err}",
            )
        try:
            _, wakeups = self.store.install(stored)
        except StoreError as err:
            return ErrorReply(code=err.code, message=str(err))
        self.store.persisted_version = stored.version
        self.store.state_error = None
        try:
            self._send_wakeups(socket, wakeups)
        except zmq.ZMQError as err:  # the long-polls then end at their timeout
            log.error("could not wake long-polls for version %d: %s", stored.version, err)
        self._log_commit(stored, persisted=True)
        return Committed(version=stored.version, persisted=True)

    def _install_staged(self, push: PendingPush) -> StoredVersion:
        """A file push: verify the file the pusher wrote, rename it into place, serve its mapping."""
        assert self.config.state_dir is not None and push.staging is not None
        mapped = install_staged(
            self.config.state_dir,
            push.staging,
            push.version,
            push.manifest,
            keep=self.config.keep,
            fsync=self.config.fsync,
        )
        return StoredVersion(
            push.version,
            push.manifest,
            push.metadata,
            mapped.frames,
            push.manifest.total_bytes,
            path=mapped.path,
        )

    def _write_and_map(self, push: PendingPush) -> StoredVersion:
        """A push of frames: write them to the version's file, then serve the file's mapping."""
        assert self.config.state_dir is not None
        frames = [f for f in push.frames if f is not None]
        path = write_state(
            self.config.state_dir,
            push.version,
            push.manifest,
            push.metadata,
            frames,
            keep=self.config.keep,
            fsync=self.config.fsync,
        )
        # Serve the file's mapping, not the received frames: the pushed bytes are freed
        # once this push is dropped, and the version's pages are the page cache's, shared
        # with the workers on this host that map the same file (`PullBegin.local`). The
        # frames were verified on arrival and the file was written from them: no re-hash.
        mapped = map_state(path, verify=False, expect=push.manifest)
        return StoredVersion(
            push.version, push.manifest, push.metadata, mapped.frames, push.manifest.total_bytes, path=path
        )
