"""How the parameter server answers a puller: `PullBegin`, `FetchChunks`, `PullEnd`."""

from __future__ import annotations

from typing import Any

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.store import VersionStore
from rlax_protocol import Ack, FetchChunks, NotNewer, PullBegin, PullEnd, PullGranted
from rlax_protocol.messages import Chunks


class PullPath:
    """Answers the pull messages against `store`: leases, and the frames sent under them."""

    def __init__(self, store: VersionStore, config: ServerConfig) -> None:
        self.store = store
        self.config = config

    def begin(self, message: PullBegin, owner: bytes) -> tuple[PullGranted | NotNewer, list[Any]]:
        """A lease on the asked version (the first frames with it, or its state file for a
        puller on this host), or `NotNewer`."""
        store = self.store
        granted = store.begin_pull(message.version, message.if_newer_than, owner)
        if granted is None or isinstance(granted, int):
            return NotNewer(latest=granted), []
        lease, stored = granted
        frames: list[Any] = []
        state_file = str(stored.path) if message.local and stored.path is not None else ""
        if (message.prefetch_bytes > 0 and not state_file) or not stored.frames:
            frames = store.prefetch(lease, stored, min(message.prefetch_bytes, self.config.max_message_bytes))
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

    def fetch(self, message: FetchChunks) -> tuple[Chunks, list[Any]]:
        frames = self.store.fetch(message.lease_id, message.first_frame, message.count)
        return Chunks(message.lease_id, message.first_frame, message.count), frames

    def end(self, message: PullEnd) -> Ack:
        self.store.end_pull(message.lease_id)
        return Ack()
