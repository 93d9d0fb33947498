"""The long-polls (`WaitNewer`) waiting in the parameter server's `VersionStore`.

The list holds no lock: the store calls it under its own, so a commit and the waiters it
wakes are one step.
"""

from __future__ import annotations

from dataclasses import dataclass


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


class LongPolls:
    """Waiters in arrival order, and those ended early that `sweep` has yet to answer."""

    def __init__(self) -> None:
        self.waiters: list[Waiter] = []
        self._early_wakeups: list[Wakeup] = []

    def register(self, waiter: Waiter, latest: int | None, max_waiters: int) -> None:
        """Add `waiter`. The same client's waiters on an older connection, and beyond
        `max_waiters` the oldest ones, end now with the unchanged `latest`."""
        if waiter.client_key:
            kept: list[Waiter] = []
            for w in self.waiters:
                if w.client_key == waiter.client_key and w.identity != waiter.identity:
                    self._early_wakeups.append(Wakeup(w.identity, w.request_id, latest))
                else:
                    kept.append(w)
            self.waiters = kept
        while len(self.waiters) >= max_waiters:
            oldest = self.waiters.pop(0)
            self._early_wakeups.append(Wakeup(oldest.identity, oldest.request_id, latest))
        self.waiters.append(waiter)

    def wake_older_than(self, version: int) -> list[Wakeup]:
        """End the waiters that wait for something older than `version` (just committed)."""
        woken = [w for w in self.waiters if w.version is None or w.version < version]
        self.waiters = [w for w in self.waiters if not (w.version is None or w.version < version)]
        return [Wakeup(w.identity, w.request_id, version) for w in woken]

    def sweep(self, now: float, latest: int | None) -> list[Wakeup]:
        """The waiters ended early and those due by `now` (answered with `latest`)."""
        early, self._early_wakeups = self._early_wakeups, []
        due = [w for w in self.waiters if w.deadline <= now]
        if not due:
            return early
        self.waiters = [w for w in self.waiters if w.deadline > now]
        return early + [Wakeup(w.identity, w.request_id, latest) for w in due]

    def __len__(self) -> int:
        return len(self.waiters)
