"""The worker pool against a real worker-side ROUTER socket on loopback: liveness,
requests, their timeouts, and what it tells its work owner."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Collection, Iterator
from typing import Any

import pytest
import zmq
from loopback_peers import WorkerSocket, result_for, wait_until

from rlax_controller.metrics import MetricsWriter, read_metrics
from rlax_controller.rollout_scheduler import RolloutScheduler, RolloutSchedulerConfig
from rlax_controller.run_tally import RunTally
from rlax_controller.worker_pool import WorkerPool, WorkerState
from rlax_core.config import load_config
from rlax_protocol.messages import ErrorReply, GenerateRequest, GenerateResult, Sample, SamplingParams


class RecordingOwner:
    """A `WorkOwner` that keeps what the pool tells it."""

    def __init__(self) -> None:
        self.results: list[tuple[str, GenerateResult]] = []
        self.released: list[str] = []
        self.lost: list[tuple[str, list[str]]] = []

    def take_result(self, worker: str, result: GenerateResult) -> None:
        self.results.append((worker, result))

    def release(self, tag: str) -> None:
        self.released.append(tag)

    def worker_lost(self, worker: str, tags: Collection[str]) -> None:
        self.lost.append((worker, sorted(tags)))


class Rig:
    def __init__(self, tmp_path: pathlib.Path, toy: Any, **extra: Any) -> None:
        overrides = {
            "run.output_dir": tmp_path / "run",
            "controller.heartbeat_interval_s": 0.05,
            "controller.heartbeat_timeout_s": 60.0,  # only a test that means to makes a worker silent
            "controller.request_timeout_s": 60.0,
            "trainer.k": 1,
            **extra,
        }
        self.config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
        self.scheduler = RolloutScheduler(
            toy.Source(),
            RolloutSchedulerConfig(
                group_size=2, prompts_per_step=2, k=1, versions="freshest", lookahead_steps=None
            ),
        )
        self.tally = RunTally(self.scheduler.counters)
        self.metrics = MetricsWriter(self.config.output_dir, tensorboard=False)
        self.owner = RecordingOwner()
        self.worker = WorkerSocket(f"tcp://127.0.0.1:{toy.port()}")
        self.pool = WorkerPool(
            self.config,
            [self.worker.address],
            context=zmq.Context.instance(),
            owner=self.owner,
            scheduler=self.scheduler,
            metrics=self.metrics,
            tally=self.tally,
        )
        self.state: WorkerState = self.pool.workers["worker0"]

    def pump(self) -> None:
        self.worker.serve()
        now = time.monotonic()
        self.pool.poll(now)
        self.pool.heartbeat(now)

    def alive(self) -> None:
        wait_until(lambda: self.state.alive, self.pump)

    def send(self, tag: str, n: int = 2) -> GenerateRequest:
        request = GenerateRequest(
            request_id=tag, prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=4, seed=1), n=n
        )
        assert self.pool.send(self.state, request)
        return request

    def events(self, event: str) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.metrics.path, kind="worker") if r["event"] == event]

    def close(self) -> None:
        self.pool.close()
        self.worker.close()
        self.metrics.close()


@pytest.fixture
def rig(tmp_path: pathlib.Path, toy: Any) -> Iterator[Any]:
    made: list[Rig] = []

    def make(**extra: Any) -> Rig:
        made.append(Rig(tmp_path, toy, **extra))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_worker_that_answers_hello_is_alive_and_its_result_reaches_the_owner(rig: Any) -> None:
    r = rig()
    r.alive()
    assert [e["worker"] for e in r.events("alive")] == ["worker0"]
    assert [w.name for w in r.pool.ready(time.monotonic())] == ["worker0"]
    r.send("g1")
    assert r.pool.live_tags() == {"g1"} and r.pool.inflight() == 1
    request, generate = r.worker.take_generate(r.pump)
    r.worker.answer(request, result_for(generate, version=0))
    wait_until(lambda: r.owner.results, r.pump)
    assert [(w, res.request_id) for w, res in r.owner.results] == [("worker0", "g1")]
    assert r.pool.inflight() == 0 and r.state.version == 0 and not r.owner.released


def test_a_result_for_another_request_is_ignored_and_its_request_released(rig: Any) -> None:
    r = rig()
    r.alive()
    r.send("g1")
    request, generate = r.worker.take_generate(r.pump)
    r.worker.answer(request, result_for(generate, request_id="g0"))
    wait_until(lambda: r.owner.released, r.pump)
    assert r.owner.released == ["g1"] and not r.owner.results
    assert r.tally.counters["results_ignored"] == 1


@pytest.mark.parametrize(
    "sample",
    [
        {"token_ids": (3, 4), "logprobs": ()},  # no logprobs
        {"token_ids": (-1, 4), "logprobs": (-0.5, -0.5)},  # a negative token id
    ],
)
def test_a_malformed_result_costs_its_request_not_the_worker(rig: Any, sample: dict[str, Any]) -> None:
    r = rig()
    r.alive()
    r.send("g1", n=1)
    request, _ = r.worker.take_generate(r.pump)
    bad = GenerateResult(request_id="g1", samples=(Sample(finish_reason="stop", **sample),), weight_version=0)
    r.worker.answer(request, bad)
    wait_until(lambda: r.owner.released, r.pump)
    assert r.owner.released == ["g1"] and not r.owner.results
    assert r.tally.counters["bad_worker_replies"] == 1 and r.state.alive


def test_a_refused_request_goes_back_to_the_owner(rig: Any) -> None:
    r = rig()
    r.alive()
    r.send("g1")
    request, _ = r.worker.take_generate(r.pump)
    r.worker.answer(request, ErrorReply(code="overloaded", message="queue full"))
    wait_until(lambda: r.owner.released, r.pump)
    assert r.owner.released == ["g1"] and r.state.alive


def test_an_unreadable_reply_drops_the_link_and_declares_the_worker_dead(rig: Any) -> None:
    r = rig()
    r.alive()
    r.send("g1")
    request, _ = r.worker.take_generate(r.pump)
    r.worker.send_raw(request, b"\xdd\xff\xff\xff\xff")
    wait_until(lambda: r.owner.lost, r.pump)
    assert r.owner.lost == [("worker0", ["g1"])] and r.pool.inflight() == 0
    assert "protocol error" in r.events("dead")[0]["why"]


def answer_one(r: Rig, tag: str) -> None:
    """The worker's first result: its first compilation is behind it."""
    r.send(tag)
    request, generate = r.worker.take_generate(r.pump)
    r.worker.answer(request, result_for(generate, version=0))
    wait_until(lambda: r.state.answered, r.pump)


def test_an_unanswered_request_times_out_and_quarantines_the_worker(rig: Any) -> None:
    r = rig(**{"controller.request_timeout_s": 2.0})
    r.alive()
    answer_one(r, "g0")
    r.send("g1")
    r.worker.take_generate(r.pump)
    later = time.monotonic() + 3.0  # past the request timeout, within the heartbeat timeout
    r.worker.serve()
    r.pool.heartbeat(later)
    assert r.owner.released == ["g1"] and r.tally.counters["requests_timed_out"] == 1
    assert r.state.alive and r.state.timeouts == 1
    assert r.pool.ready(later) == [] and r.state.quarantine_until == pytest.approx(later + 2.0)


def test_a_worker_gets_the_first_result_timeout_until_it_answers(rig: Any) -> None:
    """Before its first result a worker is compiling the run's shapes: its requests wait
    `first_result_timeout_s`; once it answered, `request_timeout_s`. A new life starts over."""
    r = rig(**{"controller.request_timeout_s": 2.0, "controller.first_result_timeout_s": 10.0})
    r.alive()
    r.send("g1")
    request, generate = r.worker.take_generate(r.pump)
    sent = time.monotonic()
    r.pool.heartbeat(sent + 5.0)  # past request_timeout_s, within first_result_timeout_s
    assert not r.owner.released and r.pool.inflight() == 1 and r.state.timeouts == 0
    r.worker.answer(request, result_for(generate, version=0))
    wait_until(lambda: r.state.answered, r.pump)
    r.send("g2")
    r.worker.take_generate(r.pump)
    r.pool.heartbeat(time.monotonic() + 3.0)
    assert r.owner.released == ["g2"] and r.state.timeouts == 1
    r.worker.server_id = "life2"  # restarted: compiles again
    r.state.last_ping = 0.0  # the heartbeats above ran ahead of the clock: ping now
    wait_until(lambda: not r.state.answered and r.state.link.server_id == "life2", r.pump)
    r.pool.heartbeat(r.state.quarantine_until)  # the quarantine ran out, nothing else changed
    r.send("g3")
    r.worker.take_generate(r.pump)
    r.pool.heartbeat(time.monotonic() + 5.0)
    assert r.owner.released == ["g2"]


def test_the_first_answer_restarts_the_clock_of_the_requests_held_through_the_compilation(rig: Any) -> None:
    """Requests sent into a worker's first compilation are being served once it answers
    one: they get `request_timeout_s` from that answer, not from when they were sent."""
    r = rig(**{"controller.request_timeout_s": 2.0, "controller.first_result_timeout_s": 60.0})
    r.alive()
    r.send("g1")
    r.send("g2")
    first, generate1 = r.worker.take_generate(r.pump)
    r.worker.take_generate(r.pump)
    for request_id in r.state.sent_at:
        r.state.sent_at[request_id] -= 40.0  # sent 40 s ago, into the compilation
    r.worker.answer(first, result_for(generate1, version=0))
    wait_until(lambda: r.owner.results, r.pump)
    answered = time.monotonic()
    r.pool.heartbeat(answered + 1.0)
    assert not r.owner.released and r.pool.inflight() == 1
    r.pool.heartbeat(answered + 3.0)
    assert r.owner.released == ["g2"]


def test_requests_that_time_out_together_are_one_strike_and_a_late_answer_lifts_it(rig: Any) -> None:
    r = rig(**{"controller.request_timeout_s": 2.0})
    r.alive()
    answer_one(r, "g0")
    r.send("g1")
    r.send("g2")
    first, generate1 = r.worker.take_generate(r.pump)
    r.worker.take_generate(r.pump)
    later = time.monotonic() + 3.0
    r.pool.heartbeat(later)
    assert sorted(r.owner.released) == ["g1", "g2"] and r.tally.counters["requests_timed_out"] == 2
    assert r.state.timeouts == 1 and r.state.quarantine_until == pytest.approx(later + 2.0)
    assert r.pool.ready(later) == []
    # It was slow, not hung: its late answer is not used, but work may go to it again.
    r.worker.answer(first, result_for(generate1, version=0))
    wait_until(lambda: r.tally.counters.get("results_ignored") == 1, r.pump)
    assert [w.name for w in r.pool.ready(later)] == ["worker0"] and r.state.timeouts == 0
    assert [res.request_id for _, res in r.owner.results] == ["g0"]


def test_an_answer_to_a_request_it_was_never_sent_lifts_no_quarantine(rig: Any) -> None:
    r = rig(**{"controller.request_timeout_s": 2.0})
    r.alive()
    answer_one(r, "g0")
    r.send("g1")
    request, generate = r.worker.take_generate(r.pump)
    later = time.monotonic() + 3.0
    r.pool.heartbeat(later)
    assert r.state.timeouts == 1
    r.worker.answer(request, result_for(generate, request_id="stranger"))
    wait_until(lambda: r.tally.counters.get("results_ignored") == 1, r.pump)
    assert r.pool.ready(later) == [] and r.state.timeouts == 1


def test_a_silent_worker_is_declared_dead_with_its_requests(rig: Any) -> None:
    r = rig(**{"controller.heartbeat_timeout_s": 1.0})
    r.alive()
    r.send("g1")
    r.pool.heartbeat(r.state.last_seen + 1.5)
    assert not r.state.alive and r.owner.lost == [("worker0", ["g1"])]
    assert "silent for 1.5s" in r.events("dead")[0]["why"]


def test_a_restarted_worker_loses_the_requests_of_its_previous_life(rig: Any) -> None:
    r = rig()
    r.alive()
    r.send("g1")
    r.worker.take_generate(r.pump)
    r.worker.server_id = "life2"
    wait_until(lambda: r.owner.lost, r.pump)
    assert r.owner.lost == [("worker0", ["g1"])]
    assert "restarted (server id life1 -> life2)" in r.events("dead")[0]["why"]
    wait_until(lambda: r.state.alive, r.pump)  # the new life is welcome


def test_a_worker_far_behind_the_run_is_quarantined_and_reloads_are_counted(rig: Any) -> None:
    r = rig(**{"workers.j": 1})
    r.alive()
    for tag, version in (("g1", 0), ("g2", 1)):
        r.send(tag)
        request, generate = r.worker.take_generate(r.pump)
        r.worker.answer(request, result_for(generate, version=version))
        wait_until(lambda tag=tag: any(res.request_id == tag for _, res in r.owner.results), r.pump)
    assert r.state.reloads == 1
    assert [(e["from_version"], e["to_version"]) for e in r.events("version")] == [(0, 1)]
    assert "stale_worker_results" not in r.tally.counters
    r.scheduler.step = 10  # the run moved on; the worker still generates with version 1
    before = time.monotonic()
    r.send("g3")
    request, generate = r.worker.take_generate(r.pump)
    r.worker.answer(request, result_for(generate, version=1))
    wait_until(lambda: len(r.owner.results) == 3, r.pump)
    assert r.tally.counters["stale_worker_results"] == 1
    assert r.state.quarantine_until >= before + r.config.controller.request_timeout_s


def test_a_worker_moved_to_another_address_is_reconnected_there(
    rig: Any, toy: Any, tmp_path: pathlib.Path
) -> None:
    from rlax_core.addresses import write_address_book

    book = tmp_path / "addresses.json"
    r = rig(**{"addresses.book": book})
    r.alive()
    r.send("g1")
    moved = WorkerSocket(f"tcp://127.0.0.1:{toy.port()}", server_id="moved")
    try:
        write_address_book(book, {"worker0": moved.address})

        def pump() -> None:
            moved.serve()
            r.pump()

        wait_until(lambda: r.state.link.address == moved.address and r.state.alive, pump)
        assert r.owner.lost == [("worker0", ["g1"])]
        assert [e["why"] for e in r.events("dead")] == [f"moved to {moved.address}"]
    finally:
        moved.close()
