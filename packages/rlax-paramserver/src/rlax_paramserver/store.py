"""In-memory store of weight versions: pending pushes, commits, leases, retention, waiters.

No sockets here: the server's worker threads call these methods (all thread-safe) and
turn `StoreError`s into `ErrorReply`s. Frames are kept exactly as they arrived
(`zmq.Frame` buffers, no copy) and are sent back the same way on a pull.
"""

from __future__ import annotations

import itertools
import pathlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.persist import StagingFile, discard_staging
from rlax_protocol import PROTOCOL_VERSION, FrameSlot, TensorManifest, frame_layout


class StoreError(Exception):
    """A request the store refuses; `code` becomes the `ErrorReply` code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class StoredVersion:
    """A committed version; with `path` its frames are views of that state file's mapping."""

    version: int
    manifest: TensorManifest
    metadata: dict[str, Any]
    frames: list[memoryview]
    nbytes: int
    path: pathlib.Path | None = None


@dataclass
class PendingPush:
    push_id: int
    version: int
    manifest: TensorManifest
    metadata: dict[str, Any]
    owner: bytes
    slots: list[FrameSlot]
    frames: list[memoryview | None]
    missing: int
    touched: float
    tensor_missing: list[int]
    verified: list[bool]
    generation: list[int]
    # A push written into a file on the server's host: no frames, verified on commit.
    staging: StagingFile | None = None


@dataclass
class TensorCheck:
    """A tensor of a pending push whose frames all arrived, to be hashed."""

    push_id: int
    tensor: int
    generation: int
    frames: list[memoryview]


@dataclass
class Lease:
    """A pull in flight; it ends when every frame was sent once (`unsent` reaches 0)."""

    lease_id: int
    version: int
    expires: float
    sent: bytearray
    unsent: int
    owner: bytes = b""

    def mark_sent(self, first: int, count: int) -> None:
        for index in range(first, first + count):
            if not self.sent[index]:
                self.sent[index] = 1
                self.unsent -= 1


@dataclass
class Waiter:
    identity: bytes
    request_id: int
    version: int | None
    deadline: float
    client_key: bytes = b""


@dataclass
class Wakeup:
    """A long-poll to answer now: tell `identity` that the latest version is `latest`."""

    identity: bytes
    request_id: int
    latest: int | None


@dataclass
class VersionStore:
    config: ServerConfig
    versions: dict[int, StoredVersion] = field(default_factory=dict)
    pending: dict[int, PendingPush] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    waiters: list[Waiter] = field(default_factory=list)
    # Versions taken for commit but not yet visible (verifying, or being written to disk):
    # they count as claimed, so no other push of them or of an older version can start.
    committing: set[int] = field(default_factory=set)
    persisted_version: int | None = None
    state_error: str | None = None
    malformed_messages: int = 0
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _graveyard: list[StoredVersion] = field(default_factory=list)
    _early_wakeups: list[Wakeup] = field(default_factory=list)

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
        self, version: int, manifest: TensorManifest, metadata: dict[str, Any], owner: bytes
    ) -> int:
        if manifest.protocol_version != PROTOCOL_VERSION:
            raise StoreError(
                "version_mismatch",
                f"manifest written with protocol version {manifest.protocol_version}, server speaks version {PROTOCOL_VERSION}",
            )
        largest = max((min(manifest.chunk_bytes, t.nbytes) for t in manifest.tensors), default=0)
        if largest > self.config.max_frame_bytes:
            raise StoreError(
                "too_large",
                f"frames of {largest} bytes (chunk_bytes={manifest.chunk_bytes}) exceed max_frame_bytes={self.config.max_frame_bytes}",
            )
        if manifest.total_bytes > self.config.max_version_bytes:
            raise StoreError(
                "too_large",
                f"version of {manifest.total_bytes} bytes exceeds max_version_bytes={self.config.max_version_bytes}",
            )
        if manifest.num_frames > self.config.max_frames:
            raise StoreError(
                "too_large", f"{manifest.num_frames} frames exceed max_frames={self.config.max_frames}"
            )
        if version < 0:
            raise StoreError("malformed", f"version={version}: must be >= 0")
        slots = frame_layout(manifest)
        now = time.monotonic()
        with self._lock:
            self._expire_pushes(now)
            self._refuse_stale(version)
            mine = sorted(p.push_id for p in self.pending.values() if p.owner == owner)
            while len(mine) >= self.config.max_pending_per_client:
                self._drop_push(mine.pop(0))  # a client restarting its push abandons the older one
            if len(self.pending) >= self.config.max_pending_pushes:
                raise StoreError(
                    "busy",
                    f"{len(self.pending)} pushes pending (max_pending_pushes={self.config.max_pending_pushes})",
                )
            push_id = next(self._ids)
            counts = manifest.frames_per_tensor()
            self.pending[push_id] = PendingPush(
                push_id,
                version,
                manifest,
                dict(metadata),
                owner,
                slots,
                [None] * len(slots),
                len(slots),
                now,
                tensor_missing=counts,
                verified=[False] * len(counts),
                generation=[0] * len(counts),
            )
            return push_id

    def stage(self, push_id: int, staging: StagingFile) -> None:
        """Make a pending push a file push: its tensors arrive in `staging`, not as frames.
        Removes the file at once when the push is already gone."""
        with self._lock:
            push = self.pending.get(push_id)
            if push is None:
                discard_staging(staging)
                raise StoreError("out_of_order", f"push {push_id} ended before its staging file was made")
            push.staging = staging
            push.frames = []
            push.missing = 0
            push.touched = time.monotonic()

    def put_chunks(self, push_id: int, first_frame: int, frames: Sequence[memoryview]) -> list[TensorCheck]:
        """Store frames; returns the tensors they completed, to be hashed without the lock
        (`record_check`), so that verification overlaps with the rest of the transfer."""
        with self._lock:
            push = self._pending(push_id)
            if push.staging is not None:
                raise StoreError(
                    "malformed", f"push {push_id} is written to its staging file: send no PushChunks"
                )
            end = first_frame + len(frames)
            if first_frame < 0 or end > len(push.slots):
                raise StoreError(
                    "out_of_order",
                    f"frames {first_frame}..{end - 1} outside push {push_id}'s {len(push.slots)} frames",
                )
            for offset, frame in enumerate(frames):
                slot = push.slots[first_frame + offset]
                if frame.nbytes != slot.nbytes:
                    name = push.manifest.tensors[slot.tensor].name
                    raise StoreError(
                        "malformed",
                        f"frame {first_frame + offset} (tensor {name!r}) holds {frame.nbytes} bytes, expected {slot.nbytes}",
                    )
            touched: set[int] = set()
            for offset, frame in enumerate(frames):
                index = first_frame + offset
                tensor = push.slots[index].tensor
                if push.frames[index] is None:
                    push.missing -= 1
                    push.tensor_missing[tensor] -= 1
                push.frames[index] = frame
                push.verified[tensor] = False
                push.generation[tensor] += 1
                touched.add(tensor)
            push.touched = time.monotonic()
            return [
                TensorCheck(push_id, t, push.generation[t], self._tensor_frames(push, t))
                for t in sorted(touched)
                if push.tensor_missing[t] == 0
            ]

    @staticmethod
    def _tensor_frames(push: PendingPush, tensor: int) -> list[memoryview]:
        return [f for s, f in zip(push.slots, push.frames) if s.tensor == tensor and f is not None]

    @staticmethod
    def hash_frames(frames: Sequence[memoryview]) -> int:
        hasher = xxhash.xxh3_64()
        for frame in frames:
            hasher.update(frame)
        return hasher.intdigest()

    def record_check(self, check: TensorCheck, digest: int) -> None:
        """Remember that a completed tensor hashed to `digest` (ignored if its frames changed since)."""
        with self._lock:
            push = self.pending.get(check.push_id)
            if push is None or push.generation[check.tensor] != check.generation:
                return
            tensor = push.manifest.tensors[check.tensor]
            if digest != tensor.checksum:
                # A corrupt tensor dooms the push: drop it now rather than at commit.
                self._drop_push(check.push_id)
                raise StoreError(
                    "checksum",
                    f"tensor {tensor.name!r} of version {push.version} arrived corrupt (checksum mismatch)",
                )
            push.verified[check.tensor] = True

    def abort_push(self, push_id: int) -> None:
        with self._lock:
            self._drop_push(push_id)

    def _drop_push(self, push_id: int) -> None:
        """Forget a pending push (lock held); a file push's staging file goes with it."""
        push = self.pending.pop(push_id, None)
        if push is not None and push.staging is not None:
            discard_staging(push.staging)

    def take_for_commit(self, push_id: int) -> PendingPush:
        """Remove a complete pending push so its checksums can be verified (and the version
        written) without the lock; its version stays claimed until `install` or `release`."""
        with self._lock:
            push = self._pending(push_id)
            if push.missing:
                absent = [i for i, f in enumerate(push.frames) if f is None]
                raise StoreError(
                    "out_of_order", f"push {push_id} misses {len(absent)} frames (first: {absent[:5]})"
                )
            del self.pending[push_id]
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
            for push_id in list(self.pending):
                self._drop_push(push_id)

    def release(self, version: int) -> None:
        """Give up a version taken for commit that will not become visible (corrupt, not persisted)."""
        with self._lock:
            self.committing.discard(version)

    def verify(self, push: PendingPush) -> None:
        """Hash the tensors not yet verified; raises StoreError('checksum') naming a corrupt one.
        A file push is verified where its file is installed (`persist.install_staged`)."""
        if push.staging is not None:
            return
        for index, tensor in enumerate(push.manifest.tensors):
            if push.verified[index]:
                continue
            if self.hash_frames(self._tensor_frames(push, index)) != tensor.checksum:
                raise StoreError(
                    "checksum",
                    f"tensor {tensor.name!r} of version {push.version} arrived corrupt (checksum mismatch)",
                )

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
            self.versions[stored.version] = stored
            self._evict(time.monotonic())
            woken = [w for w in self.waiters if w.version is None or w.version < stored.version]
            self.waiters = [w for w in self.waiters if not (w.version is None or w.version < stored.version)]
            return stored, [Wakeup(w.identity, w.request_id, stored.version) for w in woken]

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
            if owner:
                mine = [lid for lid, held in self.leases.items() if held.owner == owner]
                for lid in mine[: max(0, len(mine) - self.config.max_leases_per_client + 1)]:
                    del self.leases[lid]  # dict order is lease order: the oldest go first
            while len(self.leases) >= self.config.max_leases:
                # The oldest pull in flight is most likely a dead client's; a live one
                # gets `not_found` for its lease and `ParamClient.pull` begins again.
                del self.leases[next(iter(self.leases))]
            lease = Lease(
                next(self._ids),
                wanted,
                now + self.config.lease_ttl_s,
                bytearray(len(stored.frames)),
                len(stored.frames),
                owner,
            )
            self.leases[lease.lease_id] = lease
            self._evict(now)  # versions the dropped leases held
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
            self.leases.pop(lease_id, None)
            self._evict(time.monotonic())

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
            if client_key:
                kept: list[Waiter] = []
                for w in self.waiters:
                    if w.client_key == client_key and w.identity != identity:
                        self._early_wakeups.append(Wakeup(w.identity, w.request_id, latest))
                    else:
                        kept.append(w)
                self.waiters = kept
            while len(self.waiters) >= self.config.max_waiters:
                oldest = self.waiters.pop(0)
                self._early_wakeups.append(Wakeup(oldest.identity, oldest.request_id, latest))
            self.waiters.append(waiter)
            return waiter

    def sweep(self) -> list[Wakeup]:
        """Expire leases, idle pushes and due long-polls; returns the long-polls to answer."""
        now = time.monotonic()
        with self._lock:
            self._expire_leases(now)
            self._expire_pushes(now)
            early, self._early_wakeups = self._early_wakeups, []
            due = [w for w in self.waiters if w.deadline <= now]
            if not due:
                return early
            self.waiters = [w for w in self.waiters if w.deadline > now]
            latest = self.latest
            return early + [Wakeup(w.identity, w.request_id, latest) for w in due]

    # ------------------------------------------------------------------ internals (lock held)

    def _sent(self, lease: Lease, first: int, count: int) -> None:
        lease.mark_sent(first, count)
        if lease.unsent == 0 and self.leases.pop(lease.lease_id, None) is not None:
            # Every frame is on its way (ZeroMQ holds references to the buffers): the pull is done.
            self._evict(time.monotonic())

    def _refuse_stale(self, version: int) -> None:
        claimed = self._newest_claimed()
        if claimed is not None and version <= claimed:
            latest = self.latest
            being = "" if claimed == latest else f" (version {claimed} is being committed)"
            raise StoreError(
                "stale_version",
                f"version {version} is not newer than the latest committed version {latest}{being}",
            )

    def _pending(self, push_id: int) -> PendingPush:
        push = self.pending.get(push_id)
        if push is None:
            raise StoreError(
                "out_of_order", f"push {push_id} is unknown (never begun, aborted, expired or committed)"
            )
        return push

    def _expire_leases(self, now: float) -> None:
        expired = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in expired:
            del self.leases[lid]
        if expired:
            self._evict(now)

    def _expire_pushes(self, now: float) -> None:
        for push_id in [
            p.push_id for p in self.pending.values() if now - p.touched > self.config.push_idle_timeout_s
        ]:
            self._drop_push(push_id)

    def _evict(self, now: float) -> None:
        # The newest `keep` versions stay; an older one stays only while a pull of it is in flight.
        leased = {lease.version for lease in self.leases.values()}
        for version in sorted(self.versions)[: -self.config.keep]:
            if version not in leased:
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
            self._expire_pushes(now)
            by_version: dict[int, int] = {}
            for lease in self.leases.values():
                by_version[lease.version] = by_version.get(lease.version, 0) + 1
            pending_bytes = sum(f.nbytes for p in self.pending.values() for f in p.frames if f is not None)
            return {
                "versions": tuple(sorted(self.versions)),
                "latest": self.latest,
                "bytes_held": sum(v.nbytes for v in self.versions.values()) + pending_bytes,
                "pulls_in_flight": len(self.leases),
                "leases_by_version": by_version,
                "pending_pushes": len(self.pending),
                "malformed_messages": self.malformed_messages,
                "persisted_version": self.persisted_version,
                "state_error": self.state_error,
                "waiters": len(self.waiters),
            }
