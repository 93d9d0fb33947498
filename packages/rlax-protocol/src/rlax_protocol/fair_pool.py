"""Threads for a server's slow work, shared fairly between its clients.

A server that runs slow work (sandboxed programs, environment steps) in one queue serves
it in arrival order: one client that sends many slow requests, or one very slow one, makes
everyone behind it wait. `FairPool` keeps one queue per client and takes the clients in
turn (round-robin), and no client may run more than `max_running_per_client` jobs at once,
so a free thread always goes to the client that has waited longest for its turn and one
client can never hold every thread. How much a client may queue is the server's decision
(see `rlax_data.verifier_process`): the pool itself queues what it is given. `FairQueue` is the
same turn-taking without threads, for work a server does on its own thread in slices.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

__all__ = ["FairPool", "FairQueue"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class FairQueue(Generic[T]):
    """One FIFO queue per client; `turn()` names the client whose turn it is (the one that
    has waited longest since its last turn) and sends it to the back. Not thread-safe."""

    def __init__(self) -> None:
        self._queues: collections.OrderedDict[Hashable, collections.deque[T]] = collections.OrderedDict()

    def put(self, client: Hashable, item: T) -> None:
        self._queues.setdefault(client, collections.deque()).append(item)

    def turn(self, eligible: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        """The next client with waiting items (and `eligible`, if given), now last in
        line; None when there is none. A client whose queue the caller emptied leaves."""
        for client in list(self._queues):
            queue = self._queues[client]
            if not queue:
                del self._queues[client]
            elif eligible is None or eligible(client):
                self._queues.move_to_end(client)
                return client
        return None

    def waiting(self, client: Hashable) -> collections.deque[T]:
        """`client`'s queue, oldest first (the caller may take from its head)."""
        return self._queues.get(client) or collections.deque()

    def clear(self) -> list[T]:
        """Empty every queue; returns what waited."""
        items = [item for queue in self._queues.values() for item in queue]
        self._queues.clear()
        return items

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return any(self._queues.values())


@dataclasses.dataclass(eq=False)
class _Job:
    client: Hashable
    work: Callable[[], Any]
    future: Future[Any]


class FairPool:
    """Runs `work()` calls in `threads` daemon threads, one queue per client, the clients
    taken in turn; a client runs at most `max_running_per_client` jobs at once (default:
    half the threads, at least one)."""

    def __init__(
        self, threads: int, *, max_running_per_client: int | None = None, name: str = "rlax-fair"
    ) -> None:
        if threads < 1:
            raise ValueError(f"FairPool: threads={threads}: must be >= 1")
        cap = max(1, threads // 2) if max_running_per_client is None else max_running_per_client
        if cap < 1:
            raise ValueError(f"FairPool: max_running_per_client={cap}: must be >= 1")
        self.threads = threads
        self.max_running_per_client = cap
        self.name = name
        self._cond = threading.Condition()
        self._queue: FairQueue[_Job] = FairQueue()
        self._running: collections.Counter[Hashable] = collections.Counter()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def running(self) -> int:
        with self._cond:
            return sum(self._running.values())

    def submit(self, client: Hashable, work: Callable[[], T]) -> Future[T]:
        """Queue `work()` for `client`; its future holds the result or the Exception it raised."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            self._queue.put(client, _Job(client, work, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Cancel what waits; what runs finishes in its (daemon) thread."""
        with self._cond:
            self._closed = True
            waiting = self._queue.clear()
            self._cond.notify_all()
        for job in waiting:
            job.future.cancel()

    def _take(self) -> _Job | None:
        """The oldest job of the next client below its limit; None when no job may start."""
        client = self._queue.turn(lambda c: self._running[c] < self.max_running_per_client)
        if client is None:
            return None
        self._running[client] += 1
        return self._queue.waiting(client).popleft()

    def _serve(self) -> None:
        while True:
            with self._cond:
                job = self._take()
                while job is None:
                    if self._closed:
                        return
                    self._cond.wait()
                    job = self._take()
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(job.work())
                    except BaseException as error:  # the job's own failure, for its caller
                        job.future.set_exception(error)
            except BaseException:  # never lose a thread of the pool
                log.exception("%s: a job failed outside its work", self.name)
            finally:
                with self._cond:
                    self._running[job.client] -= 1
                    if not self._running[job.client]:
                        del self._running[job.client]
                    self._cond.notify_all()  # that client may start its next job
