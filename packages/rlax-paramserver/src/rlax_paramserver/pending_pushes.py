"""The pushes in flight of the parameter server's `VersionStore`: frames arriving, tensors
verified as they complete, idle pushes expired.

Every `PendingPushes` method runs under the store's lock (the store takes it): the table
itself holds no lock, so one lock orders pushes, versions and pulls together. Hashing and
`verify_push` (a push taken out of the table) run without it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.persist import StagingFile, discard_staging
from rlax_paramserver.store_error import StoreError
from rlax_protocol import PROTOCOL_VERSION, FrameSlot, TensorManifest, checksum_frames


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
    # The manifest's checksums come with the commit (`PushBegin.checksums_follow`): a
    # tensor's hash is kept in `digests` (valid where `verified`) and compared then.
    checksums_follow: bool = False
    digests: list[int] = field(default_factory=list)
    # Tensor i's frames are frames[first_frames[i] : first_frames[i + 1]] (tensors in order).
    first_frames: list[int] = field(default_factory=list)


@dataclass
class TensorCheck:
    """A tensor of a pending push whose frames all arrived, to be hashed."""

    push_id: int
    tensor: int
    generation: int
    frames: list[memoryview]


class PendingPushes:
    """Pending pushes by push id (dict order is push order)."""

    def __init__(self) -> None:
        self.pending: dict[int, PendingPush] = {}

    def add(
        self,
        push_id: int,
        version: int,
        manifest: TensorManifest,
        metadata: dict[str, Any],
        owner: bytes,
        slots: list[FrameSlot],
        now: float,
        checksums_follow: bool = False,
    ) -> None:
        """A new push; `slots` is `frame_layout(manifest)` (worked out before the lock is taken)."""
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
            checksums_follow=checksums_follow,
            digests=[0] * len(counts) if checksums_follow else [],
            first_frames=[0, *itertools.accumulate(counts)],
        )

    def of_owner(self, owner: bytes) -> list[int]:
        """The push ids `owner` has pending, oldest first."""
        return sorted(p.push_id for p in self.pending.values() if p.owner == owner)

    def get(self, push_id: int) -> PendingPush:
        push = self.pending.get(push_id)
        if push is None:
            raise StoreError(
                "out_of_order", f"push {push_id} is unknown (never begun, aborted, expired or committed)"
            )
        return push

    def stage(self, push_id: int, staging: StagingFile) -> None:
        push = self.pending.get(push_id)
        if push is None:
            discard_staging(staging)
            raise StoreError("out_of_order", f"push {push_id} ended before its staging file was made")
        push.staging = staging
        push.frames = []
        push.missing = 0
        push.touched = time.monotonic()

    def put_chunks(self, push_id: int, first_frame: int, frames: Sequence[memoryview]) -> list[TensorCheck]:
        push = self.get(push_id)
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
            TensorCheck(push_id, t, push.generation[t], tensor_frames(push, t))
            for t in sorted(touched)
            if push.tensor_missing[t] == 0
        ]

    def record_check(self, check: TensorCheck, digest: int) -> None:
        push = self.pending.get(check.push_id)
        if push is None or push.generation[check.tensor] != check.generation:
            return
        if push.checksums_follow:  # compared with the commit's checksums
            push.digests[check.tensor] = digest
            push.verified[check.tensor] = True
            return
        tensor = push.manifest.tensors[check.tensor]
        if digest != tensor.checksum:
            # A corrupt tensor dooms the push: drop it now rather than at commit.
            self.drop(check.push_id)
            raise StoreError(
                "checksum",
                f"tensor {tensor.name!r} of version {push.version} arrived corrupt (checksum mismatch)",
            )
        push.verified[check.tensor] = True

    def drop(self, push_id: int) -> None:
        """Forget a pending push; a file push's staging file goes with it."""
        push = self.pending.pop(push_id, None)
        if push is not None and push.staging is not None:
            discard_staging(push.staging)

    def take_complete(self, push_id: int) -> PendingPush:
        """Remove and return a push whose every frame arrived."""
        push = self.get(push_id)
        if push.missing:
            absent = [i for i, f in enumerate(push.frames) if f is None]
            raise StoreError(
                "out_of_order", f"push {push_id} misses {len(absent)} frames (first: {absent[:5]})"
            )
        del self.pending[push_id]
        return push

    def expire(self, now: float, idle_timeout_s: float) -> None:
        for push_id in [p.push_id for p in self.pending.values() if now - p.touched > idle_timeout_s]:
            self.drop(push_id)

    def frame_bytes(self) -> int:
        """Bytes of the frames received so far, every pending push together."""
        return sum(f.nbytes for p in self.pending.values() for f in p.frames if f is not None)

    def __len__(self) -> int:
        return len(self.pending)


def tensor_frames(push: PendingPush, tensor: int) -> list[memoryview]:
    start, end = push.first_frames[tensor], push.first_frames[tensor + 1]
    return [f for f in push.frames[start:end] if f is not None]


def verify_push(push: PendingPush, checksums: Sequence[int] = ()) -> None:
    """Hash the tensors not yet hashed; raises StoreError('checksum') naming a corrupt one.
    `checksums` are the commit's (`PushBegin.checksums_follow`): the manifest then takes
    them once every tensor matched. A file push is verified where its file is installed
    (`persist.install_staged`)."""
    tensors = push.manifest.tensors
    if push.checksums_follow and len(checksums) != len(tensors):
        raise StoreError(
            "malformed",
            f"PushCommit carries {len(checksums)} checksums; push {push.push_id} has {len(tensors)} tensors",
        )
    if not push.checksums_follow and checksums:
        raise StoreError(
            "malformed",
            f"PushCommit carries checksums; push {push.push_id} sent them in its manifest",
        )
    if push.staging is not None:
        return
    for index, tensor in enumerate(tensors):
        if push.checksums_follow:
            digest = (
                push.digests[index] if push.verified[index] else checksum_frames(tensor_frames(push, index))
            )
            matched = digest == checksums[index]
        else:
            matched = push.verified[index] or checksum_frames(tensor_frames(push, index)) == tensor.checksum
        if not matched:
            raise StoreError(
                "checksum",
                f"tensor {tensor.name!r} of version {push.version} arrived corrupt (checksum mismatch)",
            )
    if push.checksums_follow:
        headers = tuple(msgspec.structs.replace(h, checksum=c) for h, c in zip(tensors, checksums))
        push.manifest = msgspec.structs.replace(push.manifest, tensors=headers)


def check_push_size(manifest: TensorManifest, config: ServerConfig) -> None:
    """Refuse a push whose protocol version or sizes the server does not take."""
    if manifest.protocol_version != PROTOCOL_VERSION:
        raise StoreError(
            "version_mismatch",
            f"manifest written with protocol version {manifest.protocol_version}, server speaks version {PROTOCOL_VERSION}",
        )
    largest = max((min(manifest.chunk_bytes, t.nbytes) for t in manifest.tensors), default=0)
    if largest > config.max_frame_bytes:
        raise StoreError(
            "too_large",
            f"frames of {largest} bytes (chunk_bytes={manifest.chunk_bytes}) exceed max_frame_bytes={config.max_frame_bytes}",
        )
    if manifest.total_bytes > config.max_version_bytes:
        raise StoreError(
            "too_large",
            f"version of {manifest.total_bytes} bytes exceeds max_version_bytes={config.max_version_bytes}",
        )
    if manifest.num_frames > config.max_frames:
        raise StoreError("too_large", f"{manifest.num_frames} frames exceed max_frames={config.max_frames}")
