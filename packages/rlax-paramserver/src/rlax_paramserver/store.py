"""In-memory store of weight versions: pending pushes, commits, leases, retention, waiters.

No sockets here: the server's worker threads call these methods (all thread-safe) and
turn `StoreError`s into `ErrorReply`s. Frames are kept exactly as they arrived
(`zmq.Frame` buffers, no copy) and are sent back the same way on a pull.

`VersionStore` holds the versions and the one lock; its parts, each called under that
lock, keep the rest: `pending_pushes` the pushes in flight, `leases` the pulls in
flight, `long_polls` the waiters.
"""

from __future__ import annotations

import itertools
import pathlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.leases import Lease, LeaseTable
from rlax_paramserver.long_polls import LongPolls, Waiter, Wakeup
from rlax_paramserver.pending_pushes import (
    PendingPush,
    PendingPushes,
    TensorCheck,
    check_push_size,
    verify_push,
)
from rlax_paramserver.persist import StagingFile, discard_staging
from rlax_paramserver.store_error import StoreError
from rlax_protocol import TensorManifest, checksum_frames, frame_layout
from rlax_protocol.lora_versions import LoraVersionError, lora_base_of

__all__ = [
    "Lease",
    "PendingPush",
    "StoreError",
    "StoredVersion",
    "TensorCheck",
    "VersionStore",
    "Waiter",
    "Wakeup",
]


@dataclass
class StoredVersion:
    """A committed version; with `path` its frames are views of that state file's mapping."""

    version: int
    manifest: TensorManifest
    metadata: dict[str, Any]
    frames: list[memoryview]
    nbytes: int
    path: pathlib.Path | None = None


class VersionStore:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.versions: dict[int, StoredVersion] = {}
        self.pushes = PendingPushes()
        self.leases = LeaseTable()
        self.long_polls = LongPolls()
        # Versions taken for commit but not yet visible (verifying, or being written to disk):
        # they count as claimed, so no other push of them or of an older version can start.
        self.committing: set[int] = set()
        self.persisted_version: int | None = None
        self.state_error: str | None = None
        self.malformed_messages = 0
        self._ids = itertools.count(1)  # push and lease ids alike
        self._lock = threading.Lock()
        self._graveyard: list[StoredVersion] = []

    # ------------------------------------------------------------------ queries

    @property
    def latest(self) -> int | None:
        return max(self.versions) if self.versions else None

    def _newest_claimed(self) -> int | None:
        """The newest version visible or being committed (lock held)."""
        claimed = [*self.versions, *self.committing]
        return max(claimed) if claimed else None

    def count_malformed(self) -> None:
        with self._lock:
            self.malformed_messages += 1

    # ------------------------------------------------------------------ push

    def begin_push(
        self,
        version: int,
        manifest: TensorManifest,
        metadata: dict[str, Any],
        owner: bytes,
        checksums_follow: bool = False,
    ) -> int:
        check_push_size(manifest, self.config)
        if version < 0:
            raise StoreError("malformed", f"version={version}: must be >= 0")
        base = _named_base(version, metadata)
        slots = frame_layout(manifest)
        now = time.monotonic()
        with self._lock:
            self.pushes.expire(now, self.config.push_idle_timeout_s)
            self._refuse_stale(version)
            self._require_base(version, base)
            mine = self.pushes.of_owner(owner)
            while len(mine) >= self.config.max_pending_per_client:
                self.pushes.drop(mine.pop(0))  # a client restarting its push abandons the older one
            if len(self.pushes) >= self.config.max_pending_pushes:
                raise StoreError(
                    "busy",
                    f"{len(self.pushes)} pushes pending (max_pending_pushes={self.config.max_pending_pushes})",
                )
            push_id = next(self._ids)
            self.pushes.add(push_id, version, manifest, metadata, owner, slots, now, checksums_follow)
            return push_id

    def stage(self, push_id: int, staging: StagingFile) -> None:
        """Make a pending push a file push: its tensors arrive in `staging`, not as frames.
        Removes the file at once when the push is already gone."""
        with self._lock:
            self.pushes.stage(push_id, staging)

    def put_chunks(self, push_id: int, first_frame: int, frames: Sequence[memoryview]) -> list[TensorCheck]:
        """Store frames; returns the tensors they completed, to be hashed without the lock
        (`record_check`), so that verification overlaps with the rest of the transfer."""
        with self._lock:
            return self.pushes.put_chunks(push_id, first_frame, frames)

    @staticmethod
    def hash_frames(frames: Sequence[memoryview]) -> int:
        return checksum_frames(frames)

    def record_check(self, check: TensorCheck, digest: int) -> None:
        """Remember that a completed tensor hashed to `digest` (ignored if its frames changed since)."""
        with self._lock:
            self.pushes.record_check(check, digest)

    def abort_push(self, push_id: int) -> None:
        with self._lock:
            self.pushes.drop(push_id)

    def take_for_commit(self, push_id: int) -> PendingPush:
        """Remove a complete pending push so its checksums can be verified (and the version
        written) without the lock; its version stays claimed until `install` or `release`."""
        with self._lock:
            push = self.pushes.take_complete(push_id)
            try:
                self._refuse_stale(push.version)
            except StoreError:
                if push.staging is not None:
                    discard_staging(push.staging)
                raise
            self.committing.add(push.version)
            return push

    def drop_all_pushes(self) -> None:
        """Forget every pending push (the server stops): no staging file is left behind."""
        with self._lock:
            for push_id in list(self.pushes.pending):
                self.pushes.drop(push_id)

    def release(self, version: int) -> None:
        """Give up a version taken for commit that will not become visible (corrupt, not persisted)."""
        with self._lock:
            self.committing.discard(version)

    def verify(self, push: PendingPush, checksums: Sequence[int] = ()) -> None:
        """Hash the tensors not yet verified; raises StoreError('checksum') naming a corrupt one
        (`pending_pushes.verify_push`; `checksums` are the commit's, when they follow)."""
        verify_push(push, checksums)

    def commit(self, push: PendingPush) -> tuple[StoredVersion, list[Wakeup]]:
        frames = [f for f in push.frames if f is not None]
        stored = StoredVersion(push.version, push.manifest, push.metadata, frames, push.manifest.total_bytes)
        return self.install(stored)

    def install(self, stored: StoredVersion) -> tuple[StoredVersion, list[Wakeup]]:
        """Make `stored` visible (atomically: one dict insert under the lock); wake long-polls."""
        with self._lock:
            self.committing.discard(stored.version)
            latest = self.latest
            if latest is not None and stored.version <= latest:
                raise StoreError(
                    "stale_version",
                    f"version {stored.version} is not newer than the latest committed version {latest}",
                )
            self._require_base(stored.version, _named_base(stored.version, stored.metadata))
            self.versions[stored.version] = stored
            self._evict()
            return stored, self.long_polls.wake_older_than(stored.version)

    # ------------------------------------------------------------------ pull

    def begin_pull(
        self, version: int | None, if_newer_than: int | None, owner: bytes = b""
    ) -> tuple[Lease, StoredVersion] | int | None:
        """A lease on the requested version, or the latest version number when it is not newer.

        Leases stay bounded under reconnect churn: a client (`owner`, stable across its
        reconnections) holds at most `max_leases_per_client` (a new one ends its oldest:
        a client that reconnected abandoned its earlier pulls), and beyond `max_leases`
        in all a new pull ends the oldest pull in flight of anyone.
        """
        now = time.monotonic()
        with self._lock:
            self._expire_leases(now)
            latest = self.latest
            if latest is None:
                raise StoreError("not_found", "no version has been committed yet")
            wanted = latest if version is None else version
            if if_newer_than is not None and wanted <= if_newer_than:
                return latest
            stored = self.versions.get(wanted)
            if stored is None:
                raise StoreError("not_found", f"version {wanted} is not held (held: {sorted(self.versions)})")
            self.leases.make_room(owner, self.config.max_leases_per_client, self.config.max_leases)
            lease = self.leases.grant(
                next(self._ids), wanted, now + self.config.lease_ttl_s, len(stored.frames), owner
            )
            self._evict()  # versions the dropped leases held
            return lease, stored

    def prefetch(self, lease: Lease, stored: StoredVersion, budget: int) -> list[memoryview]:
        """The first frames of a just-granted pull (at least one, about `budget` bytes)."""
        frames: list[memoryview] = []
        total = 0
        for frame in stored.frames:
            if frames and total + frame.nbytes > budget:
                break
            frames.append(frame)
            total += frame.nbytes
        with self._lock:
            self._sent(lease, 0, len(frames))
        return frames

    def fetch(self, lease_id: int, first_frame: int, count: int) -> list[memoryview]:
        now = time.monotonic()
        with self._lock:
            self._expire_leases(now)
            lease = self.leases.get(lease_id)
            if lease is None:
                raise StoreError(
                    "not_found", f"lease {lease_id} is unknown or expired (ttl {self.config.lease_ttl_s}s)"
                )
            stored = self.versions[lease.version]
            if count <= 0 or first_frame < 0 or first_frame + count > len(stored.frames):
                raise StoreError(
                    "out_of_order",
                    f"frames {first_frame}..{first_frame + count - 1} outside version {lease.version}'s {len(stored.frames)}",
                )
            lease.expires = now + self.config.lease_ttl_s
            self._sent(lease, first_frame, count)
            return stored.frames[first_frame : first_frame + count]

    def end_pull(self, lease_id: int) -> None:
        with self._lock:
            self.leases.end(lease_id)
            self._evict()

    # ------------------------------------------------------------------ long-poll

    def wait_newer(
        self,
        identity: bytes,
        request_id: int,
        version: int | None,
        timeout_s: float,
        client_key: bytes = b"",
    ) -> int | None | Waiter:
        """The latest version if already newer than `version`; otherwise registers and returns a waiter.

        Waiters stay bounded under reconnect churn: the waiters of the same client on an
        older connection, and beyond `max_waiters` the oldest ones, are answered now with
        the unchanged latest (a long-poll may end early; the client simply asks again;
        a reply to a closed connection is dropped by ZeroMQ). `sweep` returns them.
        """
        with self._lock:
            latest = self.latest
            if latest is not None and (version is None or latest > version):
                return latest
            waiter = Waiter(
                identity,
                request_id,
                version,
                time.monotonic() + min(timeout_s, self.config.max_wait_s),
                client_key,
            )
            self.long_polls.register(waiter, latest, self.config.max_waiters)
            return waiter

    def sweep(self) -> list[Wakeup]:
        """Expire leases, idle pushes and due long-polls; returns the long-polls to answer."""
        now = time.monotonic()
        with self._lock:
            self._expire_leases(now)
            self.pushes.expire(now, self.config.push_idle_timeout_s)
            return self.long_polls.sweep(now, self.latest)

    # ------------------------------------------------------------------ internals (lock held)

    def _sent(self, lease: Lease, first: int, count: int) -> None:
        if self.leases.mark_sent(lease, first, count):
            # Every frame is on its way (ZeroMQ holds references to the buffers): the pull is done.
            self._evict()

    def _refuse_stale(self, version: int) -> None:
        claimed = self._newest_claimed()
        if claimed is not None and version <= claimed:
            latest = self.latest
            being = "" if claimed == latest else f" (version {claimed} is being committed)"
            raise StoreError(
                "stale_version",
                f"version {version} is not newer than the latest committed version {latest}{being}",
            )

    def _expire_leases(self, now: float) -> None:
        if self.leases.expire(now):
            self._evict()

    def _require_base(self, version: int, base: int | None) -> None:
        """An adapter-only version is accepted only while its base is held (a puller must
        be able to apply it); held, the base is then kept as long as the version is."""
        if base is None:
            return
        if base not in self.versions:
            raise StoreError(
                "not_found",
                f"version {version} holds adapters on base version {base}, which this server does not "
                f"hold (held: {sorted(self.versions)}): push the base first",
            )
        if _named_base(base, self.versions[base].metadata) is not None:
            raise StoreError(
                "malformed",
                f"version {version} names version {base} as its base, which holds adapters itself: "
                "a base must be a full version",
            )

    def _evict(self) -> None:
        # The newest `keep` versions stay, an older one while a pull of it is in flight, and
        # the base of every adapter-only version that stays (`rlax_protocol.lora_versions`).
        staying = set(sorted(self.versions)[-self.config.keep :]) | (
            self.leases.leased_versions() & set(self.versions)
        )
        staying |= {base for v in staying if (base := _named_base(v, self.versions[v].metadata)) is not None}
        for version in sorted(self.versions):
            if version not in staying:
                # Freeing hundreds of MB takes a while: `reap()` does it after the reply went out.
                self._graveyard.append(self.versions.pop(version))

    def reap(self) -> None:
        """Release the memory of evicted versions (outside the lock, off the reply path)."""
        with self._lock:
            dead, self._graveyard = self._graveyard, []
        del dead

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            self._expire_leases(now)
            self.pushes.expire(now, self.config.push_idle_timeout_s)
            return {
                "versions": tuple(sorted(self.versions)),
                "latest": self.latest,
                "bytes_held": sum(v.nbytes for v in self.versions.values()) + self.pushes.frame_bytes(),
                "pulls_in_flight": len(self.leases),
                "leases_by_version": self.leases.count_by_version(),
                "pending_pushes": len(self.pushes),
                "malformed_messages": self.malformed_messages,
                "persisted_version": self.persisted_version,
                "state_error": self.state_error,
                "waiters": len(self.long_polls),
            }


def _named_base(version: int, metadata: dict[str, Any]) -> int | None:
    """The base version `metadata` names (`rlax_protocol.lora_versions`), or None."""
    try:
        return lora_base_of(metadata, version)
    except LoraVersionError as err:
        raise StoreError("malformed", f"version {version}: {err}") from None
