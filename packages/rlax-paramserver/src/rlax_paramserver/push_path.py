"""How the parameter server answers a pusher: `PushBegin`, `PushChunks`, `PushCommit`, `PushAbort`.

A pusher on this host (`PushBegin.local`) is given a staging file in the state dir
instead of sending frames: it writes the tensors there, and on commit the persister
hashes the file against the manifest and renames it into place. The weights cross no
socket and the server never holds them in anonymous memory (`persist.create_staging`).
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.long_polls import Wakeup
from rlax_paramserver.persist import create_staging
from rlax_paramserver.persister import Persister, PersistJob, log_commit
from rlax_paramserver.store import StoreError, VersionStore
from rlax_protocol import Ack, Committed, PushAbort, PushBegin, PushChunks, PushCommit, PushReady, Request

log = logging.getLogger(__name__)


class PushPath:
    """Answers the push messages against `store`; with a state dir, commits go to `persister`."""

    def __init__(self, store: VersionStore, config: ServerConfig, persister: Persister | None) -> None:
        self.store = store
        self.config = config
        self.persister = persister

    def begin(self, message: PushBegin, owner: bytes) -> PushReady:
        """`owner` is the client, not the connection: a pusher that reconnects and starts
        over abandons its older pushes instead of piling them up to `busy`."""
        push_id = self.store.begin_push(
            message.version, message.manifest, message.metadata, owner, message.checksums_follow
        )
        ready = PushReady(
            push_id=push_id,
            max_message_bytes=self.config.max_message_bytes,
            max_frame_bytes=self.config.max_frame_bytes,
        )
        if message.local and self.config.state_dir is not None and not message.checksums_follow:
            return self._staged(ready, message)
        return ready

    def whole(
        self, request: Request, message: PushBegin, owner: bytes
    ) -> tuple[Committed, list[Wakeup]] | None:
        """A version pushed in one message (`PushBegin.whole`): begun, stored, verified and
        committed as its three-message form would be; nothing of it stays pending on error."""
        push_id = self.store.begin_push(message.version, message.manifest, message.metadata, owner)
        try:
            self.chunks(PushChunks(push_id, 0, len(request.frames)), request.frames)
            return self.commit(request, PushCommit(push_id))
        except BaseException:
            self.store.abort_push(push_id)  # a no-op where the commit had taken it already
            raise

    def chunks(self, message: PushChunks, frames: list[zmq.Frame]) -> Ack:
        if message.count != len(frames):
            raise StoreError("malformed", f"PushChunks says {message.count} frames, {len(frames)} attached")
        total = sum(f.buffer.nbytes for f in frames)
        if len(frames) > 1 and total > self.config.max_message_bytes:
            raise StoreError(
                "too_large",
                f"{total} bytes in one message exceed max_message_bytes={self.config.max_message_bytes}",
            )
        store = self.store
        checks = store.put_chunks(message.push_id, message.first_frame, [f.buffer for f in frames])
        for check in checks:
            store.record_check(check, store.hash_frames(check.frames))
        return Ack()

    def commit(self, request: Request, message: PushCommit) -> tuple[Committed, list[Wakeup]] | None:
        """The commit's answer and the long-polls it wakes, or None when the persister answers it."""
        push = self.store.take_for_commit(message.push_id)
        try:
            self.store.verify(push, message.checksums)
        except BaseException:
            self.store.release(push.version)
            raise
        if self.persister is not None:
            # Visible only once on disk: the persister installs it and answers.
            self.persister.jobs.put(PersistJob(request.identity, request.request_id, push))
            return None
        stored, wakeups = self.store.commit(push)
        log_commit(stored, persisted=False)
        return Committed(version=stored.version, persisted=False), wakeups

    def abort(self, message: PushAbort) -> Ack:
        self.store.abort_push(message.push_id)
        return Ack()

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
