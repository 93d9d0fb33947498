"""What the controller keeps at each weight boundary (docs/design.md, "Architecture"): the run snapshot of
step s+1 written before the batch of step s leaves, the `train` metrics record written when
the trainer commits that batch, and the restore from a snapshot when a controller restarts
or the trainer rewinds."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.metrics import MetricsWriter, generation_record, read_metrics, trajectory_record
from rlax_controller.rollout_scheduler import Batch, RolloutScheduler
from rlax_controller.run_tally import RunTally
from rlax_controller.snapshot import RunSnapshot, SnapshotStore, checkpoint_name
from rlax_controller.worker_pool import WorkerPool
from rlax_core.config import RunConfig
from rlax_protocol.control_messages import TrainBatch
from rlax_protocol.messages import Rollout, WorkerStats

__all__ = ["StepBoundaries", "batch_record"]

log = logging.getLogger("rlax.controller")


def batch_record(batch: Batch) -> dict[str, Any]:
    """The controller's fields of the `train` record of the step `batch` trains."""
    samples = [s for g in batch.groups for s in g.samples]
    return {
        "kind": "train",
        "step": batch.step + 1,
        "version": batch.step + 1,
        "reward_mean": float(np.mean([s.reward for s in samples])),
        "pass_rate": float(np.mean([s.correct for s in samples])),
        "staleness_max": max(batch.staleness),
        "staleness_mean": float(np.mean(batch.staleness)),
        "staleness": batch.staleness,
        "filtered_groups": batch.filtered,
        "response_tokens_mean": float(np.mean([len(s.token_ids) for s in samples])),
        # Per rollout, in batch order: what a benchmark needs to replay the same work.
        "response_tokens": [len(s.token_ids) for s in samples],
        **trajectory_record(samples),
        "rollout_ids": batch.rollout_ids,
        "rollout_versions": [g.version for g in batch.groups],
        # Partial rollouts: samples whose later tokens came from newer weights, and those tokens' share.
        "mixed_version_rollouts": sum(len(set(s.token_versions)) > 1 for s in samples),
        "newer_version_token_fraction": _newer_version_tokens(batch)
        / max(1, sum(len(s.token_ids) for s in samples)),
        "consumed_prompt_ids": list(batch.consumed_prompt_ids),
        "consumed_indices": list(batch.consumed_indices),
    }


def _newer_version_tokens(batch: Batch) -> int:
    """Tokens drawn by newer weights than their group's first segment (partial rollouts)."""
    return sum(v != g.version for g in batch.groups for s in g.samples for v in s.token_versions)


class StepBoundaries:
    def __init__(
        self,
        config: RunConfig,
        *,
        scheduler: RolloutScheduler,
        store: SnapshotStore,
        metrics: MetricsWriter,
        tally: RunTally,
        evaluations: EvaluationJobs,
        pool: WorkerPool,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.store = store
        self.metrics = metrics
        self.tally = tally
        self.evaluations = evaluations
        self.pool = pool
        # The figures of the trainer's last committed step (each BatchRequest carries them).
        self.trainer_metrics: dict[str, float] = {}
        self._stats_at_commit: dict[str, WorkerStats | None] = {}

    def has_snapshots(self) -> bool:
        return bool(self.store.steps())

    def write_initial_snapshot(self) -> None:
        self.store.write(
            RunSnapshot(
                step=0,
                version=0,
                stream_state=self.scheduler.base_stream_state,
                stream_index=0,
                rng_state=self.scheduler.base_rng_state,
                counters=dict(self.scheduler.counters),
                checkpoint=checkpoint_name(0),
            )
        )

    def restore(self, step: int) -> None:
        """Back to the snapshot of `step`: the scheduler, the evaluations, no request awaited."""
        snapshot = self.store.read(step)  # SnapshotError names the folder and the steps it has
        self.scheduler.restore(
            step=snapshot.step,
            next_index=snapshot.stream_index,
            stream_state=snapshot.stream_state,
            rng_state=snapshot.rng_state,
            counters=snapshot.counters,
        )
        self.evaluations.restore(snapshot.eval_history)
        self.pool.forget_requests()
        self.metrics.write(
            {"kind": "event", "step": step, "event": "restored", "checkpoint": snapshot.checkpoint}
        )
        logged = {r["step"] for r in read_metrics(self.metrics.path, kind="train")}
        if snapshot.batch_record and step not in logged:
            # The previous controller died between the trainer's commit and its metrics line;
            # the trainer's request carries that step's figures (it keeps them in its checkpoint).
            self.metrics.write(
                {
                    **self._finite_trainer_metrics(),
                    **snapshot.batch_record,
                    **snapshot.counters,
                    "recovered": True,
                }
            )
        log.info("restored snapshot of step %d (checkpoint %s)", step, snapshot.checkpoint)

    def write_pending_snapshot(self, batch: Batch) -> None:
        """The snapshot of step `batch.step + 1`: the run as it is once `batch` is trained."""
        counters = dict(self.scheduler.counters)
        counters["rollouts_trained"] = counters.get("rollouts_trained", 0) + sum(
            len(g.samples) for g in batch.groups
        )
        counters["groups_filtered"] = counters.get("groups_filtered", 0) + batch.filtered
        self.store.write(
            RunSnapshot(
                step=batch.step + 1,
                version=batch.step + 1,
                stream_state=batch.stream_state_after,
                stream_index=batch.consumed_indices[-1] + 1,
                rng_state=batch.rng_state_after,
                counters=counters,
                checkpoint=checkpoint_name(batch.step + 1),
                batch_rollout_ids=batch.rollout_ids,
                batch_prompt_indices=list(batch.consumed_indices),
                eval_history=self.evaluations.history,
                batch_record=batch_record(batch),
            )
        )

    def train_batch(self, batch: Batch) -> TrainBatch:
        rollouts: list[Rollout] = []
        for group in batch.groups:
            assert group.version is not None
            for i, sample in enumerate(group.samples):
                rollouts.append(
                    Rollout(
                        prompt_id=group.item.prompt_id,
                        group_index=i,
                        prompt_token_ids=group.item.prompt_token_ids,
                        completion_token_ids=sample.token_ids,
                        worker_logprobs=sample.logprobs,
                        policy_version=group.version,
                        finish_reason=sample.finish_reason,  # type: ignore[arg-type]
                        reward=sample.reward,
                        completion_mask=sample.model_mask,
                        turn_ends=sample.turn_ends,
                        turn_rewards=sample.turn_rewards,
                        token_versions=sample.token_versions,
                    )
                )
        return TrainBatch(
            step=batch.step,
            group_size=self.config.data.group_size,
            rollouts=tuple(rollouts),
            rollout_ids=tuple(batch.rollout_ids),
        )

    def write_train_record(self, batch: Batch) -> None:
        """The `train` record of the step `batch` trained (the trainer committed it): the
        trainer's figures, the batch's, and the step's rates, gauges and counters."""
        record: dict[str, Any] = {
            **self._finite_trainer_metrics(),
            **batch_record(batch),
            **self.tally.close_step(
                time.monotonic(),
                queue_depth=self.scheduler.pending,
                inflight_groups=self.pool.inflight(),
                workers_alive=self.pool.alive_count(),
            ),
        }
        stats = self.pool.stats()
        record.update(generation_record(self._stats_at_commit, stats))
        self._stats_at_commit = stats
        self.metrics.write(record)
        log.info(
            "step %d committed: reward %.3f staleness %s",
            self.scheduler.step,
            record["reward_mean"],
            batch.staleness,
        )

    def _finite_trainer_metrics(self) -> dict[str, float]:
        """The trainer's figures, placed before the controller's own fields so that they never
        replace them (a metric named `step` or `kind` would misfile the record); only finite
        numbers are kept."""
        return {
            k: v for k, v in self.trainer_metrics.items() if isinstance(v, int | float) and math.isfinite(v)
        }
