"""The controller process: the only component that decides (docs/design.md, "Architecture").

One event loop over ZeroMQ sockets (no threads): a ROUTER where the trainer asks for
batches (`trainer_endpoint`), one DEALER link per inference worker carrying
`GenerateRequest`s (`worker_pool`), and the run snapshot on disk (`step_boundaries`). The
decisions themselves live in `rollout_scheduler.RolloutScheduler`; `rollout_dispatch` sends
its groups and the evaluation prompts (`evaluation_jobs`), `rollout_results` scores what
comes back, and every part counts into one `run_tally.RunTally`.

Weight boundaries. The trainer asks for the batch of step s (`BatchRequest(s)`); before
that batch leaves, the snapshot of step s+1 (the stream state after the batch, counters,
the batch's rollout ids) is written. When the trainer next asks with step s+1 the batch
is committed. A restarted controller waits for the trainer's first request and restores
the snapshot of exactly the step the trainer's checkpoint holds; a trainer that fell back
to an older checkpoint rewinds the controller the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.metrics import MetricsWriter, plot_run, read_metrics, summary_rows
from rlax_controller.partial_rollouts import SegmentPlan
from rlax_controller.rollout_dispatch import RolloutDispatch
from rlax_controller.rollout_results import RolloutResults, RolloutScorer
from rlax_controller.rollout_scheduler import (
    Batch,
    BatchNotReady,
    PromptItem,
    PromptSource,
    RolloutScheduler,
    RolloutSchedulerConfig,
)
from rlax_controller.run_tally import RunTally
from rlax_controller.snapshot import SnapshotStore
from rlax_controller.step_boundaries import StepBoundaries
from rlax_controller.trainer_endpoint import TrainerEndpoint
from rlax_controller.worker_pool import WorkerPool
from rlax_core.config import RunConfig
from rlax_protocol.control_messages import BatchRequest, NoBatchYet, RunComplete, RunStatus, StatusQuery
from rlax_protocol.messages import ErrorReply, Message

__all__ = ["Controller", "RolloutScorer"]

log = logging.getLogger("rlax.controller")


class Controller:
    """Runs the RL loop's control plane until the last step is trained and evaluated."""

    def __init__(
        self,
        config: RunConfig,
        *,
        source: PromptSource,
        scorer: RolloutScorer,
        eval_items: Sequence[PromptItem] = (),
        stop_token_ids: tuple[int, ...] = (),
        worker_addresses: Sequence[str],
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        context = context or zmq.Context.instance()
        self.output = config.output_dir
        self.store = SnapshotStore(self.output / "snapshots", keep=config.controller.snapshot_keep)
        self.metrics = MetricsWriter(self.output)
        self.scheduler = RolloutScheduler(source, _scheduler_config(config))
        self.tally = RunTally(self.scheduler.counters)
        self.trainer = TrainerEndpoint(
            config, context=context, answer=self._answer, may_hold=lambda: self.restored, tally=self.tally
        )
        self.evaluations = EvaluationJobs(
            config,
            eval_items,
            self.metrics,
            run_evaluated=self._finish,
            # The run's task decodes final answers for the per-problem eval file, where it can.
            decode=getattr(scorer, "decode", None),
        )
        self.results = RolloutResults(self.scheduler, self.evaluations, scorer, self.tally)
        self.pool = WorkerPool(
            config,
            worker_addresses,
            context=context,
            owner=self.results,
            scheduler=self.scheduler,
            metrics=self.metrics,
            tally=self.tally,
        )
        self.dispatch = RolloutDispatch(
            config,
            scheduler=self.scheduler,
            evaluations=self.evaluations,
            pool=self.pool,
            stop_token_ids=stop_token_ids,
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
        self.restored = False  # the trainer's first request restores the run and starts the dispatch
        self.sent_batch: Batch | None = None  # sent to the trainer, not yet committed
        self.finished = False  # trained, evaluated and summarised
        self.complete_replied = False  # the trainer has been told the run is complete

    # ------------------------------------------------------------------ trainer's requests
    def _answer(self, message: Message) -> Message:
        if isinstance(message, StatusQuery):
            return RunStatus(
                step=self.scheduler.step,
                total_steps=self.config.run.steps,
                workers_alive=self.pool.alive_count(),
                counters=dict(self.scheduler.counters),
                finished=self.finished,
            )
        if isinstance(message, BatchRequest):
            return self._on_batch_request(message)
        return ErrorReply(
            code="unknown_message", message=f"controller does not serve {type(message).__name__}"
        )

    def _on_batch_request(self, request: BatchRequest) -> Message:
        step = request.trainer_step
        # The figures of the trainer's last committed step (resent after its restarts).
        self.boundaries.trainer_metrics = dict(request.metrics)
        if not self.restored:
            if step == 0 and not self.boundaries.has_snapshots():
                self.boundaries.write_initial_snapshot()
            else:
                self._restore(step)
            self.restored = True
            self.evaluations.start_if_due(self.scheduler.step)
        elif self.sent_batch is not None and step == self.sent_batch.step + 1:
            with self.tally.timed("controller_bookkeeping_seconds"):
                self.scheduler.commit(self.sent_batch)
            committed, self.sent_batch = self.sent_batch, None
            self.boundaries.write_train_record(committed)
            self.evaluations.start_if_due(self.scheduler.step)
        elif step != self.scheduler.step:
            log.warning(
                "trainer is at step %d, controller at %d: rewinding to the trainer's snapshot",
                step,
                self.scheduler.step,
            )
            self._restore(step)
            self.evaluations.start_if_due(step)
        if self.scheduler.step >= self.config.run.steps:
            if self.finished:
                self.complete_replied = True
                return RunComplete(final_step=self.scheduler.step)
            return NoBatchYet(reason="final evaluation", retry_after_s=0.2)
        if self.evaluations.holds(self.scheduler.step):
            # Hold version `step` still until its evaluation is scored: the eval measures it.
            return NoBatchYet(reason=f"evaluation at step {self.scheduler.step}", retry_after_s=0.05)
        if self.sent_batch is None:
            try:
                with self.tally.timed("controller_bookkeeping_seconds"):
                    batch = self.scheduler.build_batch()
            except BatchNotReady as why:
                return NoBatchYet(reason=str(why), retry_after_s=0.02)
            with self.tally.timed("controller_snapshot_seconds"):
                self.boundaries.write_pending_snapshot(batch)
            self.sent_batch = batch
        return self.boundaries.train_batch(self.sent_batch)

    def _restore(self, step: int) -> None:
        self.boundaries.restore(step)
        self.sent_batch = None
        self.finished = False

    def _finish(self) -> None:
        """The run's last step is trained and evaluated: the summary table and plot."""
        if self.finished:
            return
        self.finished = True
        records = read_metrics(self.metrics.path)
        try:
            plot_run(records, self.output / "summary.png", title=f"RLAX run {self.config.run.name}")
        except Exception:  # the plot is a convenience; the metrics are already on disk
            log.exception("could not draw the summary plot")
        lines = [" | ".join(row) for row in summary_rows(records)]
        (self.output / "summary.txt").write_text("\n".join(lines) + "\n")
        self.metrics.write({"kind": "event", "step": self.scheduler.step, "event": "finished"})

    # ------------------------------------------------------------------ main loop
    def run(self, *, stop_after_complete_s: float = 2.0, max_seconds: float | None = None) -> int:
        """Serve until the trainer has been told the run is complete; returns an exit code."""
        started = time.monotonic()
        completed_at: float | None = None
        while True:
            now = time.monotonic()
            if max_seconds is not None and now - started > max_seconds:
                raise TimeoutError(f"controller ran longer than {max_seconds}s")
            self.trainer.serve()
            self.pool.poll(now)
            self.results.release_orphans(self.pool.live_tags())
            self.pool.heartbeat(now)
            if self.restored:
                self.dispatch.dispatch(now)
            self.trainer.answer_held(now)
            if self.complete_replied:
                completed_at = completed_at or now
                if now - completed_at > stop_after_complete_s:
                    return 0
            # Sockets are re-created when a worker is declared dead; the poll set is rebuilt each turn.
            poller = zmq.Poller()
            poller.register(self.trainer.socket, zmq.POLLIN)
            for socket in self.pool.sockets():
                poller.register(socket, zmq.POLLIN)
            poller.poll(20)

    def close(self) -> None:
        self.pool.close()
        self.trainer.close()
        self.metrics.close()


def _scheduler_config(config: RunConfig) -> RolloutSchedulerConfig:
    return RolloutSchedulerConfig(
        group_size=config.data.group_size,
        prompts_per_step=config.data.prompts_per_step,
        k=config.trainer.k,
        dynamic_filter=config.data.dynamic_filter,
        max_filter_draws=config.data.max_filter_draws,
        max_inflight_per_worker=config.workers.max_inflight_groups,
        seed=config.run.seed,
        lookahead_steps=config.lookahead_steps,
        versions=config.controller.versions,
        lag=config.pinned_lag,
        j=config.workers.j,
        segments=SegmentPlan(
            tokens=config.partial_segment_tokens if config.workers.on_new_version == "interrupt" else 0,
            max_new_tokens=config.data.max_new_tokens,
            max_seq_len=config.model.max_seq_len,
            newest_lag=config.workers.segment_newest_lag,
            same_worker=config.workers.resume_kv == "keep",
        ),
    )
