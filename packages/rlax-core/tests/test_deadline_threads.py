"""DeadlineThreads: an abandoned call gives its slot back at once, a busy one is
interrupted, a blocked one is counted and bounded, and nothing the work raises (sys.exit,
the interrupt itself) escapes into the caller or the thread machinery."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from rlax_core.deadline_threads import DeadlineThreads, NoThread, Overloaded, WorkExited
from rlax_core.testing import wait_until


def test_results_errors_and_order():
    threads = DeadlineThreads(2)
    assert threads.run(lambda: 41 + 1, timeout_s=10) == 42
    with pytest.raises(ZeroDivisionError):
        threads.run(lambda: 1 / 0, timeout_s=10)
    # sys.exit in the work does not end the caller.
    with pytest.raises(WorkExited) as info:
        threads.run(lambda: exit(3), timeout_s=10)
    assert isinstance(info.value.__cause__, SystemExit)
    # More calls than slots wait in order and all run.
    gate = threading.Event()
    futures = [threads.submit(lambda i=i: gate.wait(10) and i) for i in range(6)]
    assert threads.running == 2 and threads.queued == 4
    gate.set()
    assert [f.result(timeout=10) for f in futures] == list(range(6))
    assert (threads.running, threads.queued, threads.abandoned) == (0, 0, 0)


def test_twenty_blocked_calls_never_shrink_the_capacity():
    release = threading.Event()
    threads = DeadlineThreads(2, max_abandoned=21)
    try:
        for _ in range(20):
            with pytest.raises(TimeoutError):
                threads.run(lambda: release.wait(60), timeout_s=0.01)
        assert (threads.running, threads.abandoned) == (0, 20)
        assert threads.run(lambda: "instant", timeout_s=10) == "instant"
        # The bound: past 21 abandoned threads, calls are refused at once, no thread made.
        with pytest.raises(TimeoutError):
            threads.run(lambda: release.wait(60), timeout_s=0.01)
        before = threading.active_count()
        with pytest.raises(Overloaded, match="21 abandoned calls"):
            threads.run(lambda: "never runs", timeout_s=10)
        assert threading.active_count() == before
    finally:
        release.set()
    wait_until(lambda: threads.abandoned == 0)
    assert threads.run(lambda: "again", timeout_s=10) == "again"


def test_a_busy_loop_is_interrupted():
    threads = DeadlineThreads(1)
    stopped = threading.Event()

    def spin():
        try:
            while True:
                pass
        finally:
            stopped.set()

    with pytest.raises(TimeoutError):
        threads.run(spin, timeout_s=0.05)
    assert stopped.wait(30)
    wait_until(lambda: threads.abandoned == 0)


def test_a_waiting_call_is_dropped_and_never_runs():
    gate = threading.Event()
    threads = DeadlineThreads(1)
    first = threads.submit(lambda: gate.wait(10))
    ran = []
    second = threads.submit(lambda: ran.append(1))
    assert threads.started_at(second) is None and threads.started_at(first) is not None
    threads.abandon(second)
    with pytest.raises(CancelledError):
        second.result(timeout=1)
    gate.set()
    assert first.result(timeout=10) is True
    assert ran == [] and threads.queued == 0


def test_abandoning_at_the_moment_work_ends_leaks_nothing():
    """The interrupt may be sent just as the work returns: it must be caught or cleared in
    the call's thread, never raised in the thread machinery (threading.excepthook)."""
    escaped: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    try:
        threads = DeadlineThreads(4)

        def short():
            total = 0
            for i in range(2000):
                total += i
            return total

        for i in range(300):
            future = threads.submit(short)
            time.sleep((i % 7) * 0.0001)
            threads.abandon(future)
        wait_until(lambda: threads.abandoned == 0 and threads.running == 0)
    finally:
        threading.excepthook = old_hook
    assert escaped == []
    assert threads.run(short, timeout_s=10) == sum(range(2000))


def test_a_host_out_of_threads_fails_the_call_and_keeps_the_slot(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't start new thread")

    threads = DeadlineThreads(1)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(NoThread):
        threads.run(lambda: 1, timeout_s=10)
    monkeypatch.undo()
    assert threads.running == 0 and threads.run(lambda: 1, timeout_s=10) == 1


def test_close_abandons_everything():
    release = threading.Event()
    threads = DeadlineThreads(1)
    running = threads.submit(lambda: release.wait(60))
    waiting = threads.submit(lambda: 1)
    threads.close()
    assert running.cancelled() and waiting.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit(lambda: 1)
    release.set()
    wait_until(lambda: threads.abandoned == 0)


def test_threads_are_reused_not_started_per_call():
    """A thread per call slowed the agent loop up to 4x on a loaded machine (issue 32):
    calls that return leave their threads waiting for the next ones."""
    threads = DeadlineThreads(3)
    try:
        idents = {threads.run(threading.get_ident, timeout_s=10) for _ in range(200)}
        assert len(idents) == 1  # one call at a time: the same thread every time
        gate = threading.Event()
        futures = [threads.submit(lambda: gate.wait(10) and threading.get_ident()) for _ in range(30)]
        gate.set()
        assert len({f.result(timeout=10) for f in futures}) <= 3
        wait_until(lambda: threads.idle_threads == 3)
    finally:
        threads.close()
    wait_until(lambda: threads.idle_threads == 0)


def test_idle_threads_end_after_their_timeout():
    threads = DeadlineThreads(2, idle_timeout_s=0.05)
    before = threading.active_count()
    futures = [threads.submit(lambda: time.sleep(0.01)) for _ in range(2)]
    for future in futures:
        future.result(timeout=10)
    wait_until(lambda: threading.active_count() == before and threads.idle_threads == 0)
    assert threads.run(lambda: "new thread", timeout_s=10) == "new thread"


def test_a_hung_call_takes_its_thread_out_of_the_pool():
    """The thread of an abandoned call never serves another call, even once its work ends."""
    release = threading.Event()
    threads = DeadlineThreads(1)
    try:
        # Thread objects, not idents: the system reuses the ident of a thread that ended.
        hung: list[threading.Thread] = []
        with pytest.raises(TimeoutError):
            threads.run(lambda: hung.append(threading.current_thread()) or release.wait(60), timeout_s=0.05)
        release.set()
        wait_until(lambda: threads.abandoned == 0)
        served = {threads.run(threading.current_thread, timeout_s=10) for _ in range(20)}
        assert hung and hung[0] not in served and len(served) == 1
    finally:
        threads.close()
