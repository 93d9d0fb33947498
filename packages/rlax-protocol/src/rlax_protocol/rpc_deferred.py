"""Replies that `RpcServer` sends later: futures a handler returned, queued once done.

ZeroMQ sockets are not thread-safe, so a future finishing in some worker thread may not
send its reply itself: it is queued here, and a byte on a pipe wakes the serving loop
(which polls the pipe beside its socket) to send it from its own thread.
"""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future
from typing import Any


class DeferredReplies:
    """Done futures waiting for the serving loop, with the pipe that wakes it."""

    def __init__(self) -> None:
        self._finished: collections.deque[tuple[bytes, int, Future[Any]]] = collections.deque()
        # A byte is written under the lock, so never after `close()` closed the pipe.
        self._wake_lock = threading.Lock()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def wake_fd(self) -> int:
        """The file descriptor the loop polls: readable once a deferred reply is ready."""
        return self._wake_read

    def defer(self, identity: bytes, request_id: int, future: Future[Any]) -> None:
        """Queue the reply to request `request_id` of client `identity` once `future` is
        done (its callback may run in any thread)."""

        def done(f: Future[Any]) -> None:
            self._finished.append((identity, request_id, f))
            with self._wake_lock:
                if self._wake_write >= 0:
                    try:
                        os.write(self._wake_write, b"\0")
                    except BlockingIOError:
                        pass  # the pipe is full of wake-ups already

        future.add_done_callback(done)

    def clear_wakeups(self) -> None:
        """Empty the pipe (the loop woke; the queue says what is ready)."""
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass

    def pop_finished(self) -> tuple[bytes, int, Future[Any]] | None:
        """The oldest done future with the client and request it answers, or None."""
        return self._finished.popleft() if self._finished else None

    def close(self) -> None:
        with self._wake_lock:
            if self._wake_write >= 0:
                os.close(self._wake_write)
                os.close(self._wake_read)
                self._wake_write = self._wake_read = -1
