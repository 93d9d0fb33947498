"""`FairQueue` and `FairPool`: clients take turns, and one client never holds every thread."""

from __future__ import annotations

import threading
import time

import pytest

from rlax_protocol import FairPool, FairQueue


def test_clients_take_turns_oldest_turn_first() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        queue.put("a", item)
    queue.put("b", "b1")
    order = []
    while queue:
        client = queue.turn()
        assert client is not None
        order.append(queue.waiting(client).popleft())
        if client == "a" and len(order) == 1:
            queue.put("c", "c1")  # a newcomer waits behind those already waiting
    assert order == ["a1", "b1", "a2", "c1", "a3"]
    assert queue.turn() is None and len(queue) == 0


def test_a_client_that_is_not_eligible_is_skipped_and_keeps_its_place() -> None:
    queue: FairQueue[int] = FairQueue()
    queue.put("a", 1)
    queue.put("b", 2)
    assert queue.turn(lambda c: c != "a") == "b"
    assert queue.turn() == "a"  # it was skipped, not sent to the back


def test_jobs_run_in_turns_across_clients() -> None:
    pool = FairPool(1, name="test")
    order: list[str] = []
    release = threading.Event()
    try:
        started = threading.Event()
        blocker = pool.submit("x", lambda: started.set() or release.wait(60))
        assert started.wait(60)  # the one thread is taken; the rest queue up
        futures = [pool.submit(c, lambda n=f"{c}{i}": order.append(n)) for c in "ab" for i in range(3)]
        release.set()
        for future in [blocker, *futures]:
            future.result(10)
        assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    finally:
        pool.close()


def test_one_client_runs_at_most_half_the_threads() -> None:
    pool = FairPool(4, name="test")
    release = threading.Event()
    try:
        slow = [pool.submit("a", lambda: release.wait(60)) for _ in range(4)]
        # Two threads are left for others: the pool settles there (more running never would).
        deadline = time.monotonic() + 60
        while (pool.running, pool.queued) != (2, 2):
            assert time.monotonic() < deadline, (pool.running, pool.queued)
            time.sleep(0.01)
        assert pool.submit("b", lambda: "b ran").result(5) == "b ran"
        release.set()
        assert all(f.result(10) for f in slow)
    finally:
        pool.close()


def test_a_failing_job_fails_alone_and_close_cancels_what_waits() -> None:
    pool = FairPool(1, name="test")
    release = threading.Event()
    failing = pool.submit("a", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    started = threading.Event()
    running = pool.submit("a", lambda: started.set() or release.wait(60))
    assert started.wait(60)  # the one thread is taken: the next job waits
    waiting = pool.submit("b", lambda: "never")
    pool.close()
    assert waiting.cancelled()
    release.set()
    assert running.result(5) is True
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("a", lambda: None)
