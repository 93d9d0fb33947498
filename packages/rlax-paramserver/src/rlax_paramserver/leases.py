"""The pulls in flight of the parameter server's `VersionStore`, as leases on versions.

A leased version is not evicted while its pull lasts. The table holds no lock: the store
calls it under its own, which also guards the versions the leases point at.
"""

from __future__ import annotations

from dataclasses import dataclass


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


class LeaseTable:
    """Leases by lease id (dict order is lease order: the oldest come first)."""

    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}

    def make_room(self, owner: bytes, max_per_client: int, max_leases: int) -> None:
        """End leases so that one more fits: `owner`'s oldest beyond `max_per_client` (a
        client that reconnected abandoned its earlier pulls), then anyone's oldest beyond
        `max_leases` (most likely a dead client's; a live one gets `not_found` for its
        lease and `ParamClient.pull` begins again)."""
        if owner:
            mine = [lid for lid, held in self.leases.items() if held.owner == owner]
            for lid in mine[: max(0, len(mine) - max_per_client + 1)]:
                del self.leases[lid]
        while len(self.leases) >= max_leases:
            del self.leases[next(iter(self.leases))]

    def grant(self, lease_id: int, version: int, expires: float, frames: int, owner: bytes) -> Lease:
        lease = Lease(lease_id, version, expires, bytearray(frames), frames, owner)
        self.leases[lease_id] = lease
        return lease

    def get(self, lease_id: int) -> Lease | None:
        return self.leases.get(lease_id)

    def end(self, lease_id: int) -> None:
        self.leases.pop(lease_id, None)

    def mark_sent(self, lease: Lease, first: int, count: int) -> bool:
        """Record frames sent under `lease`; True when that ended it (every frame is on its way)."""
        lease.mark_sent(first, count)
        return lease.unsent == 0 and self.leases.pop(lease.lease_id, None) is not None

    def expire(self, now: float) -> bool:
        """End the leases whose time ran out; True when any did."""
        expired = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in expired:
            del self.leases[lid]
        return bool(expired)

    def leased_versions(self) -> set[int]:
        return {lease.version for lease in self.leases.values()}

    def count_by_version(self) -> dict[int, int]:
        by_version: dict[int, int] = {}
        for lease in self.leases.values():
            by_version[lease.version] = by_version.get(lease.version, 0) + 1
        return by_version

    def __len__(self) -> int:
        return len(self.leases)
