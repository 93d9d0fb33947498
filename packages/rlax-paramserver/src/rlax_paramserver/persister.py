"""The parameter server's persister: the thread that makes committed versions durable.

With a state dir a committed version becomes visible only once it is on disk: a worker
verifies the push and queues it here; the persister writes the file (or, for a push
written into a staging file on this host, verifies and renames that file), installs the
version, wakes long-polls and answers the commit. A write that fails answers the commit
with ``persist_failed`` and the version never becomes visible; the thread lives on.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from rlax_paramserver.broker import POLL_MS, WORKER_SEND, send_wakeups
from rlax_paramserver.config import ServerConfig
from rlax_paramserver.persist import (
    CorruptStateError,
    discard_staging,
    install_staged,
    map_state,
    write_state,
)
from rlax_paramserver.store import PendingPush, StoredVersion, StoreError, VersionStore
from rlax_protocol import Committed, ErrorReply, Message, encode
from rlax_protocol.transport import pack_request_id

log = logging.getLogger(__name__)


@dataclass
class PersistJob:
    """A verified push to persist, and the commit request to answer when done."""

    identity: bytes
    request_id: int
    push: PendingPush


def log_commit(stored: StoredVersion, *, persisted: bool) -> None:
    log.info(
        "committed version %d (%d tensors, %d bytes%s)",
        stored.version,
        len(stored.manifest.tensors),
        stored.nbytes,
        ", on disk" if persisted else "",
    )


class Persister:
    """Persists the pushes queued on `jobs`, one at a time, in commit order."""

    def __init__(self, store: VersionStore, config: ServerConfig) -> None:
        self.store = store
        self.config = config
        self.jobs: queue.Queue[PersistJob] = queue.Queue()

    def run(self, context: zmq.Context[Any], backend_address: str, stop: threading.Event) -> None:
        """Commit the queued pushes until `stop` is set, answering each through the broker."""
        socket = context.socket(zmq.DEALER)
        socket.linger = 0
        socket.identity = b"persister"
        socket.connect(backend_address)
        try:
            while not stop.is_set():
                try:
                    job = self.jobs.get(timeout=POLL_MS / 1000)
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
                        [WORKER_SEND, job.identity, pack_request_id(job.request_id), encode(reply)]
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
            send_wakeups(socket, wakeups)
        except zmq.ZMQError as err:  # the long-polls then end at their timeout
            log.error("could not wake long-polls for version %d: %s", stored.version, err)
        log_commit(stored, persisted=True)
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
