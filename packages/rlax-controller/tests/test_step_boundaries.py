"""StepBoundaries with a real scheduler, snapshot store and metrics file: what is kept at
each weight boundary and what a restore brings back."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.metrics import MetricsWriter, read_metrics
from rlax_controller.rollout_results import RolloutResults
from rlax_controller.rollout_scheduler import Batch, RolloutScheduler, RolloutSchedulerConfig, ScoredSample
from rlax_controller.run_tally import RunTally
from rlax_controller.snapshot import SnapshotStore
from rlax_controller.step_boundaries import StepBoundaries
from rlax_controller.worker_pool import WorkerPool
from rlax_core.config import load_config


class Rig:
    def __init__(self, tmp_path: pathlib.Path, toy: Any) -> None:
        config = load_config(
            None, [f"run.output_dir={tmp_path / 'run'}", "data.group_size=2", "data.prompts_per_step=2"]
        )
        self.scheduler = RolloutScheduler(
            toy.Source(),
            RolloutSchedulerConfig(
                group_size=2,
                prompts_per_step=2,
                k=1,
                max_inflight_per_worker=4,
                versions="freshest",
                lookahead_steps=None,
            ),
        )
        self.tally = RunTally(self.scheduler.counters)
        self.metrics = MetricsWriter(config.output_dir, tensorboard=False)
        self.store = SnapshotStore(config.output_dir / "snapshots")
        self.evaluations = EvaluationJobs(config, [], self.metrics, run_evaluated=lambda: None)
        results = RolloutResults(self.scheduler, self.evaluations, toy.Scorer(), self.tally)
        # No worker: the pool's gauges read zero; its requests are what a restore forgets.
        self.pool = WorkerPool(
            config,
            [],
            context=zmq.Context.instance(),
            owner=results,
            scheduler=self.scheduler,
            metrics=self.metrics,
            tally=self.tally,
        )
        self.boundaries = StepBoundaries(
            config,
            scheduler=self.scheduler,
            store=self.store,
            metrics=self.metrics,
            tally=self.tally,
            evaluations=self.evaluations,
            pool=self.pool,
        )

    def batch(self) -> Batch:
        """The current step's batch, its groups generated at the step's version."""
        for _, group in self.scheduler.assign(["worker0"]):
            assert group.request_id is not None
            samples = [ScoredSample((4, 5), (-0.5, -0.5), "stop", float(i), i == 1) for i in range(2)]
            self.scheduler.complete(group.request_id, self.scheduler.step, samples)
        return self.scheduler.build_batch()


@pytest.fixture
def rig(tmp_path: pathlib.Path, toy: Any) -> Iterator[Rig]:
    made = Rig(tmp_path, toy)
    yield made
    made.metrics.close()


def test_the_initial_snapshot_is_the_stream_before_any_draw(rig: Rig) -> None:
    assert not rig.boundaries.has_snapshots()
    rig.boundaries.write_initial_snapshot()
    snapshot = rig.store.read(0)
    assert snapshot.stream_index == 0 and snapshot.stream_state == {"cursor": 0} and not snapshot.batch_record


def test_the_pending_snapshot_is_the_run_once_the_batch_is_trained(rig: Rig) -> None:
    rig.evaluations.history = [{"step": 0, "pass@1": 0.5}]
    batch = rig.batch()
    rig.boundaries.write_pending_snapshot(batch)
    snapshot = rig.store.read(1)
    assert snapshot.stream_index == batch.consumed_indices[-1] + 1 == 2
    assert snapshot.batch_rollout_ids == batch.rollout_ids and snapshot.eval_history == [
        {"step": 0, "pass@1": 0.5}
    ]
    assert snapshot.counters["rollouts_trained"] == 4 and rig.scheduler.counters["rollouts_trained"] == 0
    assert snapshot.batch_record is not None and snapshot.batch_record["consumed_prompt_ids"] == ["p0", "p1"]


def test_the_train_batch_carries_every_rollout_with_its_version(rig: Rig) -> None:
    batch = rig.batch()
    train = rig.boundaries.train_batch(batch)
    assert train.step == 0 and train.group_size == 2 and list(train.rollout_ids) == batch.rollout_ids
    assert [(r.prompt_id, r.group_index, r.reward, r.policy_version) for r in train.rollouts] == [
        ("p0", 0, 0.0, 0), ("p0", 1, 1.0, 0), ("p1", 0, 0.0, 0), ("p1", 1, 1.0, 0),
    ]  # fmt: skip


def test_the_train_record_puts_the_controllers_fields_over_the_trainers(rig: Rig) -> None:
    batch = rig.batch()
    rig.scheduler.commit(batch)
    rig.tally.add_generated(8)
    rig.boundaries.trainer_metrics = {"loss": 0.5, "step": 99.0, "kl": float("nan")}
    rig.boundaries.write_train_record(batch)
    (record,) = read_metrics(rig.metrics.path, kind="train")
    assert (record["step"], record["loss"], record["reward_mean"], record["pass_rate"]) == (1, 0.5, 0.5, 0.5)
    assert "kl" not in record  # not a finite number
    assert record["rollouts_trained"] == 4 and record["inflight_groups"] == 0 and record["workers_alive"] == 0
    assert record["gen_tokens_per_s"] > 0 and rig.tally.generated_tokens == 0


def test_a_restore_brings_back_the_snapshot_and_recovers_a_lost_train_record(rig: Rig) -> None:
    rig.boundaries.write_initial_snapshot()
    batch = rig.batch()
    rig.boundaries.write_pending_snapshot(batch)
    # The controller died after the trainer committed step 1 and before its record was written.
    rig.boundaries.trainer_metrics = {"loss": 0.25}
    rig.boundaries.restore(1)
    assert rig.scheduler.step == 1 and rig.scheduler.next_index == 2 and not rig.scheduler.groups
    records = read_metrics(rig.metrics.path)
    assert [(r["kind"], r.get("event")) for r in records] == [("event", "restored"), ("train", None)]
    assert records[1]["recovered"] is True and records[1]["loss"] == 0.25 and records[1]["step"] == 1
    rig.boundaries.restore(1)  # its record is logged now: not recovered twice
    assert len(read_metrics(rig.metrics.path, kind="train")) == 1
