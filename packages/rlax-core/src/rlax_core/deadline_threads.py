"""Threads for work that may never return: a caller that stops waiting gets its slot back.

User code runs in-process in a few places (a multi-turn environment's `step`, a tool), and
Python cannot kill a thread. A fixed pool (`ThreadPoolExecutor`) loses one of its threads
to every call that hangs, for good: after as many hung calls as it has threads, nothing
runs any more. `DeadlineThreads` keeps its threads only while they serve: when the caller
gives up on a call (`abandon`), the call's running slot goes to the next one at once (in a
new thread when no idle one is left); the hung thread is left behind, counted, and

- interrupted: `WorkAbandoned` is raised in it (CPython's `PyThreadState_SetAsyncExc`).
  That ends work that runs Python code (a busy loop, which would otherwise compete with
  the engine for the interpreter lock forever); work blocked inside one C call (a sleep, a
  lock, a socket) gets it only when that call returns;
- bounded: at most `max_abandoned` abandoned threads may be alive. Past that the process
  cannot take more hung work without growing without limit, so new calls fail at once with
  `Overloaded` (a counted error, not a wait) until abandoned threads end.

A thread whose call returned waits for the next call (up to `idle_timeout_s`) instead of
ending: starting a thread costs far more than a short call (an environment step that
formats a calculator's result), and a multi-turn run makes one call per trajectory and turn
(issue 32: on a loaded 2-core machine one multi-turn run of the demo's workload took 1.4 s
with a thread per call and 0.36 s with threads reused; on a quiet one the gain is small).
An abandoned call's thread ends when its work does.

Daemon threads never hold up the interpreter's exit.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DeadlineThreads", "NoThread", "Overloaded", "WorkAbandoned", "WorkExited"]

T = TypeVar("T")


class WorkAbandoned(BaseException):
    """Raised inside work whose caller stopped waiting (a BaseException, so that a tool's
    `except Exception` does not swallow it)."""


class Overloaded(RuntimeError):
    """A call was refused: `max_abandoned` abandoned threads are still alive."""


class NoThread(RuntimeError):
    """The host would not start a thread for a call."""


class WorkExited(RuntimeError):
    """The work raised a BaseException that is not an Exception (`sys.exit`, ...): the
    caller gets this instead, with it as the cause, and never exits for it."""


@dataclasses.dataclass(eq=False)
class _Call:
    work: Callable[[], Any]
    future: Future[Any]
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    started: float | None = None
    returned: bool = False  # the work returned or raised: no interrupt is sent after this
    abandoned: bool = False
    finished: bool = False


class DeadlineThreads:
    """Runs calls in daemon threads, at most `max_running` at once (later ones wait in order),
    and lets a caller `abandon` a call it no longer waits for.

    max_abandoned: how many abandoned threads may still be alive before new calls are
    refused with `Overloaded`. interrupt: raise `WorkAbandoned` in an abandoned call.
    idle_timeout_s: how long a thread whose call returned waits for another before it ends.
    """

    def __init__(
        self,
        max_running: int,
        *,
        max_abandoned: int = 256,
        name: str = "rlax-work",
        interrupt: bool = True,
        idle_timeout_s: float = 30.0,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"DeadlineThreads: max_running must be >= 1, got {max_running}")
        if max_abandoned < 0:
            raise ValueError(f"DeadlineThreads: max_abandoned must be >= 0, got {max_abandoned}")
        self.max_running = max_running
        self.max_abandoned = max_abandoned
        self.name = name
        self.interrupt = interrupt and hasattr(ctypes, "pythonapi")
        self._lock = threading.Lock()
        self._calls: dict[Future[Any], _Call] = {}
        self._queue: collections.deque[_Call] = collections.deque()
        self._running = 0
        self._abandoned: set[_Call] = set()
        self._closed = False
        self.idle_timeout_s = idle_timeout_s
        # Idle threads wait on `_wake` for the calls handed to them in `_handoff`; `_idle`
        # counts the threads waiting, claimed or not (a thread claims a call by popping it).
        self._wake = threading.Condition(self._lock)
        self._handoff: collections.deque[_Call] = collections.deque()
        self._idle = 0

    # -- state ---------------------------------------------------------------------------
    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def idle_threads(self) -> int:
        """Threads waiting for a call."""
        with self._lock:
            return self._idle - len(self._handoff)

    @property
    def abandoned(self) -> int:
        """Abandoned calls whose threads are still alive."""
        with self._lock:
            return len(self._abandoned)

    def started_at(self, future: Future[Any]) -> float | None:
        """When the call started running (`time.monotonic`); None while it waits for a slot
        (or once it is forgotten)."""
        with self._lock:
            call = self._calls.get(future)
            return None if call is None else call.started

    # -- calls ---------------------------------------------------------------------------
    def submit(self, work: Callable[[], T]) -> Future[T]:
        """Run `work()`: its future holds its result or the Exception it raised (`WorkExited`
        for `SystemExit` and the like), or `Overloaded`, or `NoThread`."""
        future: Future[T] = Future()
        call = _Call(work, future)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            self._calls[future] = call
            self._queue.append(call)
            self._admit()
        return future

    def run(self, work: Callable[[], T], timeout_s: float) -> T:
        """`work()`'s result, waiting at most `timeout_s` from now (its wait for a slot
        included); `TimeoutError` (the call is abandoned) after that."""
        future = self.submit(work)
        try:
            return future.result(timeout=max(0.0, timeout_s))
        except BaseException:  # the deadline, or the caller itself interrupted from outside
            self.abandon(future)
            raise

    def abandon(self, future: Future[Any]) -> None:
        """Stop waiting for the call of `future`: a waiting call is dropped; a running one
        frees its slot for the next call, is interrupted, and counts as abandoned until its
        thread ends. Nothing happens to a call that already finished."""
        with self._lock:
            call = self._calls.pop(future, None)
            if call is None or call.finished or call.abandoned:
                return
            call.abandoned = True
            future.cancel()
            if call.started is None:
                self._queue.remove(call)
                return
            self._running -= 1
            self._abandoned.add(call)
            if self.interrupt and call.thread is not None and call.thread.ident is not None:
                with call.lock:
                    if not call.returned:
                        _raise_in(call.thread.ident, WorkAbandoned)
            self._admit()

    def close(self) -> None:
        """Drop waiting calls and abandon running ones (their threads are daemons)."""
        with self._lock:
            self._closed = True  # admits nothing more
            self._wake.notify_all()  # idle threads end
            futures = list(self._calls)
        for future in futures:
            self.abandon(future)

    # -- inside ----------------------------------------------------------------------------
    def _admit(self) -> None:
        # Called with self._lock held.
        while (call := self._next_call()) is not None:
            if self._idle > len(self._handoff):  # an idle thread takes it
                self._handoff.append(call)
                self._wake.notify()
                continue
            call.thread = threading.Thread(target=self._serve, args=(call,), name=self.name, daemon=True)
            try:
                call.thread.start()
            except RuntimeError as error:  # "can't start new thread": the host's limit
                self._running -= 1
                self._calls.pop(call.future, None)
                call.finished = True
                call.future.set_exception(NoThread(f"{self.name}: {error}"))

    def _next_call(self) -> _Call | None:
        """The next waiting call that may run now, counted as running (None: none may).
        Called with self._lock held; refuses calls with `Overloaded` past `max_abandoned`."""
        while self._queue and self._running < self.max_running and not self._closed:
            call = self._queue.popleft()
            if len(self._abandoned) >= self.max_abandoned:
                self._calls.pop(call.future, None)
                call.finished = True
                call.future.set_exception(
                    Overloaded(
                        f"{self.name}: {len(self._abandoned)} abandoned calls are still running "
                        f"(at most {self.max_abandoned})"
                    )
                )
                continue
            call.started = time.monotonic()
            self._running += 1
            return call
        return None

    def _serve(self, call: _Call) -> None:
        """A thread's life: run calls (the next waiting one, or one handed to it while idle)
        until one is abandoned, the pool closes, or none comes for `idle_timeout_s`."""
        # An abandoned call's thread ends: an interrupt may have been aimed at it.
        while self._main(call):
            with self._lock:
                next_call = self._next_call() or self._wait_for_handoff()
                if next_call is None:
                    return
                call = next_call
                call.thread = threading.current_thread()

    def _wait_for_handoff(self) -> _Call | None:
        """Wait idle for a call handed to this thread (`_admit`); None when the pool closes,
        none comes for `idle_timeout_s`, or `max_running` threads are idle already. Called
        with self._lock held."""
        deadline = time.monotonic() + self.idle_timeout_s
        while not self._closed and self._idle < self.max_running:
            self._idle += 1
            while not self._handoff and not self._closed and (left := deadline - time.monotonic()) > 0:
                self._wake.wait(timeout=left)
            self._idle -= 1
            if not self._handoff:
                return None
            call = self._handoff.popleft()
            if not call.abandoned:
                return call
            self._abandoned.discard(call)  # given up before any thread took it: it never runs
            call.finished = True
        return None

    def _main(self, call: _Call) -> bool:
        """Run one call and deliver its outcome; False when it was abandoned."""
        ok, value = False, None
        try:
            try:
                value, ok = call.work(), True
            except Exception as error:
                value = error
            except BaseException as error:  # noqa: B036 - sys.exit in the work must not end the caller
                value = WorkExited(f"the work raised {type(error).__name__}")
                value.__cause__ = error
            with call.lock:
                call.returned = True
            if self.interrupt:
                _raise_in(threading.get_ident(), None)  # one sent before may still be pending
        except WorkAbandoned:  # it arrived between the work's end and the clearing above
            ok, value = False, WorkExited("the work was abandoned")
        with self._lock:
            call.finished = True
            deliver = not call.abandoned
            if call.abandoned:
                self._abandoned.discard(call)
            else:
                self._calls.pop(call.future, None)
                self._running -= 1  # this thread takes the next waiting call itself (`_serve`)
        if deliver:
            if ok:
                call.future.set_result(value)
            else:
                assert isinstance(value, Exception)
                call.future.set_exception(value)
        return deliver


def _raise_in(thread_id: int, exception: type[BaseException] | None) -> None:
    """Raise `exception` in the thread `thread_id` at its next Python instruction, or clear a
    pending one (None)."""
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    what = None if exception is None else ctypes.py_object(exception)
    if set_async(ctypes.c_ulong(thread_id), what) > 1:  # pragma: no cover - CPython's documented guard
        set_async(ctypes.c_ulong(thread_id), None)
