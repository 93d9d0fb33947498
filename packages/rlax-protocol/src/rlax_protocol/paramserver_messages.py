"""Messages of the parameter server: pushing, pulling and watching weight versions."""

from __future__ import annotations

from typing import Any

from rlax_protocol.message_base import Message, reject_field
from rlax_protocol.tensor_messages import TensorManifest

Metadata = dict[str, Any]


class PushBegin(Message, frozen=True):
    """Start pushing weight `version`; the server answers `PushReady` or an error
    (``stale_version`` when `version` is not newer than the latest). With `local` the
    pusher can write the server's files (the same host): a server that persists its
    versions then names a staging file in `PushReady` to write the tensors into instead
    of sending frames.

    With `whole` every frame of the manifest follows this message, in order: the server
    commits the version at once and answers `Committed` (or an error), one exchange in all
    instead of `PushReady`, `PushChunks` and `PushCommit`. For a version that fits one
    message (the server's `max_message_bytes`; beyond it the answer is ``too_large`` and
    the pusher starts over without `whole`).

    With `checksums_follow` the manifest's checksums are not known yet (0): the pusher
    hashes each tensor while the frames before it are on the wire and sends the checksums
    with `PushCommit`. The server hashes every tensor as it arrives and commits only if
    each matches. Such a push always sends frames (no staging file, not `whole`)."""

    version: int
    manifest: TensorManifest
    metadata: Metadata = {}
    local: bool = False
    whole: bool = False
    checksums_follow: bool = False

    def __post_init__(self) -> None:
        if self.whole and self.checksums_follow:
            reject_field("PushBegin", "checksums_follow", True, "a whole push carries its checksums")


class PushReady(Message, frozen=True):
    """With `staging_file`, write tensor i of the manifest at byte `data_offset` plus its
    64-byte-aligned offset into that file (created by the server, header written), then
    `PushCommit`; no `PushChunks`. A pusher that cannot open the file (another host)
    sends `PushAbort` and pushes again without `local`. `max_message_bytes` and
    `max_frame_bytes` are the server's limits, which a pusher needs before it sends a whole
    version in `PushBegin` (a frame above `max_frame_bytes` drops the connection)."""

    push_id: int
    max_message_bytes: int
    max_frame_bytes: int = 0
    staging_file: str = ""
    data_offset: int = 0


class PushChunks(Message, frozen=True):
    """Followed by `count` raw frames: frames ``first_frame .. first_frame+count-1`` of the manifest."""

    push_id: int
    first_frame: int
    count: int


class PushCommit(Message, frozen=True):
    """Make the pushed version visible; succeeds only if every frame arrived intact.

    `checksums`: each tensor's xxh3_64 in manifest order, when the push began with
    `checksums_follow` (and only then)."""

    push_id: int
    checksums: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(not 0 <= c < 1 << 64 for c in self.checksums):
            reject_field("PushCommit", "checksums", self.checksums, "each must be an unsigned 64-bit integer")


class PushAbort(Message, frozen=True):
    push_id: int


class Committed(Message, frozen=True):
    version: int
    persisted: bool


class PullBegin(Message, frozen=True):
    """Lease a version for pulling: `version` None means the latest. With `if_newer_than`
    the server answers `NotNewer` instead when its version is not newer. With
    `prefetch_bytes` > 0 the grant already carries the first frames (at least one, about
    that many bytes), saving a round trip. With `local` the client can read the server's
    files (the same host): the grant names the version's state file, if it has one,
    instead of carrying frames; the client maps the file and ends the lease, or fetches
    the frames as usual if it cannot use the file."""

    version: int | None = None
    if_newer_than: int | None = None
    prefetch_bytes: int = 0
    local: bool = False


class PullGranted(Message, frozen=True):
    """Followed by `first_frames` raw frames (frames ``0 .. first_frames-1``). The lease ends
    by itself once every frame was sent, or with `PullEnd`, or after `lease_ttl_s` idle."""

    lease_id: int
    version: int
    manifest: TensorManifest
    metadata: Metadata
    lease_ttl_s: float
    first_frames: int = 0
    state_file: str = ""


class NotNewer(Message, frozen=True):
    latest: int | None


class FetchChunks(Message, frozen=True):
    """Ask for frames ``first_frame .. first_frame+count-1`` of a leased version; renews the
    lease (which ends once every frame of the version was sent under it)."""

    lease_id: int
    first_frame: int
    count: int


class Chunks(Message, frozen=True):
    """Followed by `count` raw frames starting at `first_frame`."""

    lease_id: int
    first_frame: int
    count: int


class PullEnd(Message, frozen=True):
    lease_id: int


class LatestQuery(Message, frozen=True):
    pass


class WaitNewer(Message, frozen=True):
    """Long-poll: answered with `LatestVersion` once a version newer than `version`
    commits, or when `timeout_ms` runs out (then with the unchanged latest)."""

    version: int | None
    timeout_ms: int


class LatestVersion(Message, frozen=True):
    version: int | None


class StatQuery(Message, frozen=True):
    pass


class ServerStats(Message, frozen=True):
    versions: tuple[int, ...]
    latest: int | None
    bytes_held: int
    clients: int
    pulls_in_flight: int
    leases_by_version: dict[int, int]
    pending_pushes: int
    malformed_messages: int
    persisted_version: int | None
    state_error: str | None
    waiters: int = 0
