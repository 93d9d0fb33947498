"""RolloutDispatch with a real worker pool whose one worker is a ROUTER socket on loopback:
what is sent, to whom, and what becomes of work a worker cannot take."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from loopback_peers import WorkerSocket, wait_until

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.metrics import MetricsWriter
from rlax_controller.rollout_dispatch import RolloutDispatch
from rlax_controller.rollout_results import RolloutResults
from rlax_controller.rollout_scheduler import (
    GroupStatus,
    PromptItem,
    RolloutScheduler,
    RolloutSchedulerConfig,
)
from rlax_controller.run_tally import RunTally
from rlax_controller.worker_pool import WorkerPool
from rlax_core.config import load_config
from rlax_protocol.messages import GenerateRequest

EVAL_ITEMS = [PromptItem("e0", (9, 1), record={"q": 0}), PromptItem("e1", (9, 2), record={"q": 1})]


class Rig:
    def __init__(self, tmp_path: pathlib.Path, toy: Any, address: str, **extra: Any) -> None:
        overrides = {
            "run.output_dir": tmp_path / "run",
            "run.steps": 4,
            "data.group_size": 3,
            "data.prompts_per_step": 2,
            "data.temperature": 0.9,
            "eval.n_samples": 2,
            "eval.pass_k": "[1,2]",
            "eval.temperature": 0.5,
            "trainer.k": 1,
            "workers.max_inflight_groups": 2,
            "controller.heartbeat_interval_s": 0.05,
            "controller.versions": "freshest",
            **extra,
        }
        self.config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
        self.scheduler = RolloutScheduler(
            toy.Source(),
            RolloutSchedulerConfig(
                group_size=3,
                prompts_per_step=2,
                k=1,
                max_inflight_per_worker=2,
                versions=self.config.controller.versions,
                lookahead_steps=None,
            ),
        )
        self.tally = RunTally(self.scheduler.counters)
        self.metrics = MetricsWriter(self.config.output_dir, tensorboard=False)
        self.evaluations = EvaluationJobs(self.config, EVAL_ITEMS, self.metrics, run_evaluated=lambda: None)
        results = RolloutResults(self.scheduler, self.evaluations, toy.Scorer(), self.tally)
        self.pool = WorkerPool(
            self.config,
            [address],
            context=zmq.Context.instance(),
            owner=results,
            scheduler=self.scheduler,
            metrics=self.metrics,
            tally=self.tally,
        )
        self.dispatch = RolloutDispatch(
            self.config,
            scheduler=self.scheduler,
            evaluations=self.evaluations,
            pool=self.pool,
            stop_token_ids=(0,),
        )
        self.state = self.pool.workers["worker0"]


@pytest.fixture
def rig(tmp_path: pathlib.Path, toy: Any) -> Iterator[Any]:
    worker = WorkerSocket(f"tcp://127.0.0.1:{toy.port()}")
    made: list[Rig] = []

    def make(**extra: Any) -> tuple[Rig, WorkerSocket]:
        r = Rig(tmp_path, toy, worker.address, **extra)
        made.append(r)

        def pump() -> None:
            worker.serve()
            now = time.monotonic()
            r.pool.poll(now)
            r.pool.heartbeat(now)

        wait_until(lambda: r.state.alive, pump)
        return r, worker

    yield make
    for r in made:
        r.pool.close()
        r.metrics.close()
    worker.close()


def received(worker: WorkerSocket, count: int) -> list[GenerateRequest]:
    wait_until(lambda: len(worker.requests) >= count, worker.serve)
    out = [request.message for request in worker.requests]
    assert all(isinstance(m, GenerateRequest) for m in out)
    return out  # type: ignore[return-value]


def test_groups_go_to_a_ready_worker_up_to_its_room(rig: Any) -> None:
    r, worker = rig()
    r.dispatch.dispatch(time.monotonic())
    requests = received(worker, 2)
    groups = [g for g in r.scheduler.groups.values() if g.status is GroupStatus.DISPATCHED]
    assert [m.request_id for m in requests] == [g.request_id for g in groups]
    assert len(groups) == 2 == len(r.state.requests)  # workers.max_inflight_groups
    for message, group in zip(requests, groups, strict=True):
        assert message.n == 3 and message.prompt_token_ids == group.item.prompt_token_ids
        assert (message.sampling.temperature, message.sampling.seed) == (0.9, group.seed)
        assert message.sampling.stop_token_ids == (0,) and message.sampling.logprobs
        assert message.weight_version is None and message.agent is None  # freshest weights, one turn
    r.dispatch.dispatch(time.monotonic())  # no room left
    assert len(r.state.requests) == 2


def test_a_quarantined_worker_is_sent_nothing(rig: Any) -> None:
    r, worker = rig()
    r.state.quarantine_until = time.monotonic() + 60
    r.dispatch.dispatch(time.monotonic())
    assert not r.state.requests and r.tally.counters["groups_dispatched"] == 0


def test_evaluation_prompts_go_first_and_measure_the_steps_own_weights_when_pinned(rig: Any) -> None:
    r, worker = rig(**{"controller.versions": "pinned"})
    r.evaluations.start_if_due(0)
    r.dispatch.dispatch(time.monotonic())
    requests = received(worker, 2)
    assert [m.request_id.split(".")[:2] for m in requests] == [["eval0", "0"], ["eval0", "1"]]
    assert all(m.n == 2 and m.weight_version == 0 and m.sampling.temperature == 0.5 for m in requests)
    assert r.evaluations.pending() == [] and r.tally.counters["groups_dispatched"] == 0  # no room left


def test_once_the_run_is_trained_only_the_final_evaluation_is_sent(rig: Any) -> None:
    r, worker = rig(**{"workers.max_inflight_groups": 4})
    r.scheduler.step = 4
    r.evaluations.start_if_due(4)
    r.dispatch.dispatch(time.monotonic())
    requests = received(worker, 2)
    assert all(m.request_id.startswith("eval4.") and m.weight_version is None for m in requests)
    assert r.tally.counters["groups_dispatched"] == 0


def test_multi_turn_requests_carry_the_environment_and_the_prompts_record(rig: Any) -> None:
    r, worker = rig(**{"agent.environment": "calculator", "agent.max_turns": 3, "model.max_seq_len": 256})
    r.evaluations.start_if_due(0)
    r.dispatch.dispatch(time.monotonic())
    first = received(worker, 1)[0]
    assert first.agent is not None and first.agent.environment == "calculator"
    assert json.loads(first.agent.record) == {"q": 0}
    assert (first.agent.max_turns, first.agent.max_total_tokens) == (3, 256)


def test_a_worker_that_cannot_take_its_groups_is_declared_dead_and_loses_them(rig: Any) -> None:
    r, worker = rig()
    worker.close()  # gone; its link is still open
    r.state.link.open()  # a fresh socket that connects to nobody: every send is refused
    r.dispatch.dispatch(time.monotonic())
    assert not r.state.alive and not r.state.requests
    groups = list(r.scheduler.groups.values())
    assert groups and all(g.status is GroupStatus.PENDING and g.request_id is None for g in groups)
