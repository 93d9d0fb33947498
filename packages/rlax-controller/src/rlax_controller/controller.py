"""The controller process: the only component that decides (DESIGN.md §1).

One event loop over ZeroMQ sockets (no threads): a ROUTER where the trainer asks for
batches, one DEALER link per inference worker carrying `GenerateRequest`s, and the run
snapshot on disk. The decisions themselves live in `rollout_scheduler.RolloutScheduler`.

Weight boundaries. The trainer asks for the batch of step s (`BatchRequest(s)`); before
that batch leaves, the snapshot of step s+1 (the stream state after the batch, counters,
the batch's rollout ids) is written. When the trainer next asks with step s+1 the batch
is committed. A restarted controller waits for the trainer's first request and restores
the snapshot of exactly the step the trainer's checkpoint holds; a trainer that fell back
to an older checkpoint rewinds the controller the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import zmq

from rlax_controller.metrics import (
    MetricsWriter,
    generation_record,
    plot_run,
    read_metrics,
    summary_rows,
    trajectory_record,
)
from rlax_controller.rollout_scheduler import (
    Batch,
    BatchNotReady,
    GroupStatus,
    PromptItem,
    PromptSource,
    RolloutScheduler,
    RolloutSchedulerConfig,
    ScoredSample,
    stable_seed,
)
from rlax_controller.snapshot import RunSnapshot, SnapshotStore, checkpoint_name
from rlax_core.addresses import AddressBook
from rlax_core.config import ConfigError, RunConfig
from rlax_data.agent_turns import last_model_turn
from rlax_data.pass_at_k import pass_at_k
from rlax_protocol.auth import ANY_ROLE, Permissions, ServerAuth, roles
from rlax_protocol.control_messages import (
    BatchRequest,
    NoBatchYet,
    RunComplete,
    RunStatus,
    StatusQuery,
    TrainBatch,
    decode_control,
    encode_control,
)
from rlax_protocol.errors import MalformedMessageError, ProtocolError, RemoteError
from rlax_protocol.messages import (
    AgentSpec,
    ErrorReply,
    GenerateRequest,
    GenerateResult,
    Hello,
    Message,
    Rollout,
    Sample,
    SamplingParams,
    Welcome,
    WorkerStats,
)
from rlax_protocol.messages import decode as decode_protocol
from rlax_protocol.messages import encode as encode_protocol
from rlax_protocol.request_links import PeerLink
from rlax_protocol.transport import PeerRegistry, pack_request_id, unpack_request_id, welcome_for

__all__ = ["Controller", "RolloutScorer"]

log = logging.getLogger("rlax.controller")

CONTROLLER_PERMISSIONS: Permissions = {
    BatchRequest: roles("trainer"),
    StatusQuery: roles(ANY_ROLE),
}
"""Who may ask the controller what when the run authenticates: only the trainer asks for
batches (a BatchRequest moves the run to its step), anyone of the run asks for status."""

MAX_CONTROLLER_REQUEST_BYTES = 4 * 1024 * 1024
"""Largest frame the controller receives (a BatchRequest with its metrics is a few KB)."""


class RolloutScorer(Protocol):
    """Scores the completions of one prompt: one (reward, correct) per completion."""

    def score(self, item: PromptItem, completions: Sequence[tuple[int, ...]]) -> list[tuple[float, bool]]: ...


@dataclasses.dataclass
class WorkerState:
    name: str
    link: PeerLink
    alive: bool = False
    last_seen: float = 0.0
    last_ping: float = 0.0
    requests: dict[int, str] = dataclasses.field(default_factory=dict)
    pings: set[int] = dataclasses.field(default_factory=set)
    sent_at: dict[int, float] = dataclasses.field(default_factory=dict)
    timeouts: int = 0
    quarantine_until: float = 0.0
    version: int | None = None
    reloads: int = 0
    stats: WorkerStats | None = None  # the totals its latest result carried


@dataclasses.dataclass
class EvalJob:
    step: int
    items: list[PromptItem]
    status: dict[int, str]  # item index -> "pending" | request id
    results: dict[int, list[tuple[float, bool]]] = dataclasses.field(default_factory=dict)
    versions: dict[int, int] = dataclasses.field(default_factory=dict)
    samples: dict[int, tuple[Sample, ...]] = dataclasses.field(default_factory=dict)  # for tool-use figures
    started: float = dataclasses.field(default_factory=time.monotonic)


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, MalformedMessageError) else f"{type(error).__name__}: {error}"


def _check_result(result: GenerateResult) -> None:
    """What the batch built from `result` relies on; a worker that breaks it sent a malformed
    reply (checked here, where the group can still be generated again, not when the trainer
    asks for a batch that can then never be built)."""
    if result.weight_version < 0:
        raise MalformedMessageError(f"result {result.request_id!r}: weight_version={result.weight_version}")
    for i, sample in enumerate(result.samples):
        if len(sample.logprobs) != len(sample.token_ids):
            raise MalformedMessageError(
                f"result {result.request_id!r}: sample {i} has {len(sample.logprobs)} logprobs "
                f"for {len(sample.token_ids)} tokens"
            )
        if any(t < 0 for t in sample.token_ids):
            raise MalformedMessageError(f"result {result.request_id!r}: sample {i} has a negative token id")


# How long the controller holds a trainer's BatchRequest waiting for the batch; well under
# the trainer's client timeout (>= 1 s), so a held request never looks like a lost one.
BATCH_HOLD_S = 0.5


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
        self.scorer = scorer
        self.eval_items = list(eval_items)
        self.stop_token_ids = stop_token_ids
        self.context = context or zmq.Context.instance()
        self.output = config.output_dir
        self.store = SnapshotStore(self.output / "snapshots", keep=config.controller.snapshot_keep)
        self.metrics = MetricsWriter(self.output)
        self.scheduler = RolloutScheduler(
            source,
            RolloutSchedulerConfig(
                group_size=config.data.group_size,
                prompts_per_step=config.data.prompts_per_step,
                k=config.trainer.k,
                dynamic_filter=config.data.dynamic_filter,
                max_filter_draws=config.data.max_filter_draws,
                max_inflight_per_worker=config.workers.max_inflight_groups,
                seed=config.run.seed,
                lookahead_steps=config.controller.lookahead_steps,
                versions=config.controller.versions,
                lag=config.pinned_lag,
                j=config.workers.j,
            ),
        )
        self.server_id = uuid.uuid4().hex[:12]
        self.router = self.context.socket(zmq.ROUTER)
        self.router.linger = 0
        # Only the run's roles connect (when it authenticates); only its trainer asks for batches.
        self.auth = ServerAuth(
            "controller", CONTROLLER_PERMISSIONS, max_message_bytes=MAX_CONTROLLER_REQUEST_BYTES
        )
        self.auth.secure(self.context, self.router, config.controller.address)
        self.router.bind(config.controller.address)
        self.peers = PeerRegistry(idle_timeout_s=3600.0, max_peers=1024)
        self.workers = {
            f"worker{i}": WorkerState(
                f"worker{i}",
                PeerLink(
                    address,
                    encode=encode_protocol,
                    decode=decode_protocol,
                    context=self.context,
                    role="controller",
                ),
            )
            for i, address in enumerate(worker_addresses)
        }
        self.restored = False
        self.sent_batch: Batch | None = None
        self.trainer_metrics: dict[str, float] = {}
        self.eval_job: EvalJob | None = None
        self.eval_history: list[dict[str, Any]] = []
        self.finished = False
        self.complete_replied = False
        self._rate_tokens = 0
        self._rate_since = time.monotonic()
        self._stats_at_commit: dict[str, WorkerStats | None] = {}
        self._last_step_time = time.monotonic()
        # Seconds of this step's wall time spent by the controller, by part (reset at commit).
        self._step_seconds: dict[str, float] = {}
        # The trainer's BatchRequest held until a batch is ready: identity, request id, request, since.
        self._held: tuple[bytes, int, BatchRequest, float] | None = None
        # Where the launcher says each worker listens now (a worker moved to another node).
        self._book = AddressBook(config.addresses.book) if config.addresses.book else None
        self._book_read = 0.0

    @contextlib.contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self._step_seconds[part] = self._step_seconds.get(part, 0.0) + time.monotonic() - started

    # ------------------------------------------------------------------ trainer side
    def _reply(self, identity: bytes, request_id: int, message: Message) -> None:
        try:
            self.router.send_multipart(
                [identity, pack_request_id(request_id), encode_control(message)], zmq.NOBLOCK
            )
        except zmq.Again:
            log.warning("dropped a reply to a peer whose queue is full")

    def _serve_router(self) -> None:
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) < 3:
                why = f"request has {len(frames) - 1} parts after the identity, needs >= 2"
                self._reply(identity, 0, ErrorReply(code="malformed", message=why))
                continue
            try:
                request_id = unpack_request_id(frames[1])
                message = decode_control(frames[2].buffer)
            except Exception as error:  # hostile bytes (any decoder failure) get an error reply
                self._count("malformed_requests")
                self._reply(identity, 0, ErrorReply(code="malformed", message=_describe(error)))
                continue
            screened = self.peers.screen(
                identity,
                message,
                server_id=self.server_id,
                auth=self.auth,
                role=ServerAuth.role_of(frames[1]),
            )
            if screened is not None:
                # Not a scheduler counter: a restarted trainer's first request is screened too,
                # and a run's counters must not depend on who restarted when.
                self._reply(identity, request_id, screened)
                continue
            was_restored = self.restored  # the first request restores and starts the dispatch
            reply = self._answer(message)
            if was_restored and isinstance(message, BatchRequest) and isinstance(reply, NoBatchYet):
                # Held until the batch is ready (or BATCH_HOLD_S): the trainer gets it the
                # moment its last group is scored instead of at its next poll.
                if self._held is not None:
                    self._reply(
                        self._held[0], self._held[1], NoBatchYet(reason="superseded", retry_after_s=0.0)
                    )
                self._held = (identity, request_id, message, time.monotonic())
                continue
            self._reply(identity, request_id, reply)

    def _answer(self, message: Message) -> Message:
        try:
            return self._handle(message)
        except Exception as error:  # a bad request must not stop the controller
            log.exception("error handling %s", type(message).__name__)
            return ErrorReply(code="internal", message=_describe(error))

    def _answer_held(self, now: float) -> None:
        """Ask the held BatchRequest again; reply once there is a batch (or another answer),
        or `NoBatchYet` with no delay once it has waited BATCH_HOLD_S."""
        if self._held is None:
            return
        identity, request_id, request, since = self._held
        reply = self._answer(request)
        if isinstance(reply, NoBatchYet):
            if now - since < min(BATCH_HOLD_S, self.config.controller.request_timeout_s / 4):
                return
            reply = NoBatchYet(reason=reply.reason, retry_after_s=0.0)
        self._held = None
        self._reply(identity, request_id, reply)

    def _handle(self, message: Message) -> Message:
        if isinstance(message, Hello):
            return welcome_for(message, server_id=self.server_id)
        if isinstance(message, StatusQuery):
            return RunStatus(
                step=self.scheduler.step,
                total_steps=self.config.run.steps,
                workers_alive=sum(w.alive for w in self.workers.values()),
                counters=dict(self.scheduler.counters),
                finished=self.finished,
            )
        if isinstance(message, BatchRequest):
            return self._on_batch_request(message)
        return ErrorReply(
            code="unknown_message", message=f"controller does not serve {type(message).__name__}"
        )

    def _restore(self, step: int) -> None:
        snapshot = self.store.read(step)  # SnapshotError names the folder and the steps it has
        self.scheduler.restore(
            step=snapshot.step,
            next_index=snapshot.stream_index,
            stream_state=snapshot.stream_state,
            rng_state=snapshot.rng_state,
            counters=snapshot.counters,
        )
        self.eval_history = list(snapshot.eval_history)
        self.sent_batch = None
        self.eval_job = None
        self.finished = False
        self._drop_all_requests()
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

    def _initial_snapshot(self) -> None:
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

    def _on_batch_request(self, request: BatchRequest) -> Message:
        step = request.trainer_step
        # The figures of the trainer's last committed step (resent after its restarts).
        self.trainer_metrics = dict(request.metrics)
        if not self.restored:
            if step == 0 and not self.store.steps():
                self._initial_snapshot()
            else:
                self._restore(step)
            self.restored = True
            self._eval_if_due(self.scheduler.step)
        elif self.sent_batch is not None and step == self.sent_batch.step + 1:
            self._commit(self.sent_batch)
        elif step != self.scheduler.step:
            log.warning(
                "trainer is at step %d, controller at %d: rewinding to the trainer's snapshot",
                step,
                self.scheduler.step,
            )
            self._restore(step)
            self._eval_if_due(step)
        if self.scheduler.step >= self.config.run.steps:
            if self.finished:
                self.complete_replied = True
                return RunComplete(final_step=self.scheduler.step)
            return NoBatchYet(reason="final evaluation", retry_after_s=0.2)
        if self.eval_job is not None and self.eval_job.step == self.scheduler.step:
            # Hold version `step` still until its evaluation is scored: the eval measures it.
            return NoBatchYet(reason=f"evaluation at step {self.scheduler.step}", retry_after_s=0.05)
        if self.sent_batch is None:
            try:
                with self._timed("controller_bookkeeping_seconds"):
                    batch = self.scheduler.build_batch()
            except BatchNotReady as why:
                return NoBatchYet(reason=str(why), retry_after_s=0.02)
            with self._timed("controller_snapshot_seconds"):
                self._write_pending_snapshot(batch)
            self.sent_batch = batch
        return self._train_batch(self.sent_batch)

    def _batch_record(self, batch: Batch) -> dict[str, Any]:
        rewards = [s.reward for g in batch.groups for s in g.samples]
        correct = [s.correct for g in batch.groups for s in g.samples]
        return {
            "kind": "train",
            "step": batch.step + 1,
            "version": batch.step + 1,
            "reward_mean": float(np.mean(rewards)),
            "pass_rate": float(np.mean(correct)),
            "staleness_max": max(batch.staleness),
            "staleness_mean": float(np.mean(batch.staleness)),
            "staleness": batch.staleness,
            "filtered_groups": batch.filtered,
            "response_tokens_mean": float(
                np.mean([len(s.token_ids) for g in batch.groups for s in g.samples])
            ),
            # Per rollout, in batch order: what a benchmark needs to replay the same work.
            "response_tokens": [len(s.token_ids) for g in batch.groups for s in g.samples],
            **trajectory_record([s for g in batch.groups for s in g.samples]),
            "rollout_ids": batch.rollout_ids,
            "rollout_versions": [g.version for g in batch.groups],
            "consumed_prompt_ids": list(batch.consumed_prompt_ids),
            "consumed_indices": list(batch.consumed_indices),
        }

    def _write_pending_snapshot(self, batch: Batch) -> None:
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
                eval_history=self.eval_history,
                batch_record=self._batch_record(batch),
            )
        )

    def _train_batch(self, batch: Batch) -> TrainBatch:
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
                    )
                )
        return TrainBatch(
            step=batch.step,
            group_size=self.config.data.group_size,
            rollouts=tuple(rollouts),
            rollout_ids=tuple(batch.rollout_ids),
        )

    def _finite_trainer_metrics(self) -> dict[str, float]:
        """The trainer's figures, placed before the controller's own fields so that they never
        replace them (a metric named `step` or `kind` would misfile the record); only finite
        numbers are kept."""
        return {
            k: v for k, v in self.trainer_metrics.items() if isinstance(v, int | float) and math.isfinite(v)
        }

    def _commit(self, batch: Batch) -> None:
        with self._timed("controller_bookkeeping_seconds"):
            self.scheduler.commit(batch)
        self.sent_batch = None
        now = time.monotonic()
        elapsed = max(now - self._rate_since, 1e-9)
        record: dict[str, Any] = {
            **self._finite_trainer_metrics(),
            **self._batch_record(batch),
            "gen_tokens_per_s": self._rate_tokens / elapsed,
            "step_time_s": now - self._last_step_time,
            "queue_depth": self.scheduler.pending,
            "inflight_groups": sum(len(w.requests) for w in self.workers.values()),
            "workers_alive": sum(w.alive for w in self.workers.values()),
            **{k: v for k, v in self.scheduler.counters.items()},
            **self._step_seconds,
        }
        self._step_seconds = {}
        stats = {name: w.stats for name, w in self.workers.items()}
        record.update(generation_record(self._stats_at_commit, stats))
        self._stats_at_commit = stats
        self.metrics.write(record)
        self._rate_tokens = 0
        self._rate_since = now
        self._last_step_time = now
        log.info(
            "step %d committed: reward %.3f staleness %s",
            self.scheduler.step,
            record["reward_mean"],
            batch.staleness,
        )
        self._eval_if_due(self.scheduler.step)

    def _eval_if_due(self, step: int) -> None:
        every = self.config.eval.every
        due = step == 0 or step >= self.config.run.steps or (every and step % every == 0)
        if due and not any(e.get("step") == step for e in self.eval_history):
            self._start_eval(step)
        elif step >= self.config.run.steps:
            self._finish()

    # ------------------------------------------------------------------ evaluation
    def _start_eval(self, step: int) -> None:
        if not self.eval_items or self.config.eval.num_prompts == 0:
            if step >= self.config.run.steps:
                self._finish()
            return
        if self.eval_job is not None and self.eval_job.step == step:
            return
        self.eval_job = EvalJob(
            step=step, items=self.eval_items, status=dict.fromkeys(range(len(self.eval_items)), "pending")
        )

    def _finish_eval(self, job: EvalJob) -> None:
        n = self.config.eval.n_samples
        record: dict[str, Any] = {"kind": "eval", "step": job.step}
        corrects = [sum(c for _, c in job.results[i]) for i in range(len(job.items))]
        for k in self.config.eval.pass_k:
            record[f"pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in corrects]))
        record["reward_mean"] = float(np.mean([r for i in range(len(job.items)) for r, _ in job.results[i]]))
        record.update(trajectory_record([s for samples in job.samples.values() for s in samples]))
        record["version_min"] = min(job.versions.values())
        record["version_max"] = max(job.versions.values())
        record["num_prompts"] = len(job.items)
        record["seconds"] = time.monotonic() - job.started
        self.metrics.write(record)
        self.eval_history.append({k: v for k, v in record.items() if k != "kind"})
        log.info("eval at step %d: %s", job.step, {k: v for k, v in record.items() if k.startswith("pass@")})
        self.eval_job = None
        if job.step >= self.config.run.steps:
            self._finish()

    def _finish(self) -> None:
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

    # ------------------------------------------------------------------ workers
    def _drop_all_requests(self) -> None:
        for worker in self.workers.values():
            worker.requests.clear()
            worker.sent_at.clear()
        if self.eval_job is not None:
            for index, status in self.eval_job.status.items():
                if status != "done":
                    self.eval_job.status[index] = "pending"

    def _declare_dead(self, worker: WorkerState, why: str, *, reopen: bool = True) -> None:
        if worker.alive or worker.requests:
            log.warning("%s declared dead: %s", worker.name, why)
            self.metrics.write(
                {
                    "kind": "worker",
                    "step": self.scheduler.step,
                    "worker": worker.name,
                    "event": "dead",
                    "why": why,
                }
            )
        worker.alive = False
        self.scheduler.worker_lost(worker.name)
        if self.eval_job is not None:
            for index, status in self.eval_job.status.items():
                if status in worker.requests.values():
                    self.eval_job.status[index] = "pending"
        worker.requests.clear()
        worker.sent_at.clear()
        if reopen:
            worker.link.open()  # drop whatever was queued for the dead peer
            worker.pings.clear()

    def _sampling(self, *, temperature: float, seed: int) -> SamplingParams:
        data = self.config.data
        return SamplingParams(
            max_tokens=data.max_new_tokens,
            temperature=temperature,
            top_p=data.top_p,
            top_k=data.top_k,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
            logprobs=True,
        )

    def _send_generate(
        self,
        worker: WorkerState,
        tag: str,
        item: PromptItem,
        n: int,
        sampling: SamplingParams,
        version: int | None,
    ) -> bool:
        request = GenerateRequest(
            request_id=tag,
            prompt_token_ids=item.prompt_token_ids,
            sampling=sampling,
            n=n,
            weight_version=version,
            agent=self._agent_spec(item),
        )
        request_id = worker.link.send(request)
        if request_id is None:
            return False
        worker.requests[request_id] = tag
        worker.sent_at[request_id] = time.monotonic()
        return True

    def _agent_spec(self, item: PromptItem) -> AgentSpec | None:
        """Multi-turn rollouts: the environment, the prompt's record and the limits."""
        agent = self.config.agent
        if not agent.enabled:
            return None
        return AgentSpec(
            environment=agent.environment,
            record=msgspec.json.encode(item.record).decode(),
            max_turns=agent.max_turns,
            max_total_tokens=agent.max_total_tokens or self.config.model.max_seq_len,
            tool_timeout_s=agent.tool_timeout_s,
        )

    def _dispatch(self, now: float) -> None:
        alive = [w for w in self.workers.values() if w.alive and now >= w.quarantine_until]
        if not alive:
            return
        job = self.eval_job
        if job is not None:
            cap = self.config.workers.max_inflight_groups
            for index, status in job.status.items():
                if status != "pending":
                    continue
                room = [w for w in alive if len(w.requests) < cap]
                if not room:
                    break
                worker = min(room, key=lambda w: len(w.requests))
                tag = f"eval{job.step}.{index}.{uuid.uuid4().hex[:6]}"
                sampling = self._sampling(
                    temperature=self.config.eval.temperature, seed=stable_seed(self.config.eval.seed, index)
                )
                # Pinned: the evaluation of step s measures version s (the trainer waits for it).
                version = job.step if self.scheduler.pinned else None
                if self._send_generate(
                    worker, tag, job.items[index], self.config.eval.n_samples, sampling, version
                ):
                    job.status[index] = tag
        if self.scheduler.step >= self.config.run.steps:
            return  # the run is trained; only the final evaluation remains
        names = [w.name for w in alive if len(w.requests) < self.config.workers.max_inflight_groups]
        unreachable: set[str] = set()
        for name, group in self.scheduler.assign(names):
            if name in unreachable:
                continue  # released with its worker: see below
            worker = self.workers[name]
            sampling = self._sampling(temperature=self.config.data.temperature, seed=group.seed)
            assert group.request_id is not None
            if not self._send_generate(
                worker, group.request_id, group.item, self.config.data.group_size, sampling, group.pinned
            ):
                # Declared dead, the worker loses every group dispatched to it: this one, those
                # it held, and the rest of this same assignment (not sent, already released).
                unreachable.add(name)
                self._declare_dead(worker, "it is not connected", reopen=False)

    def _release_orphans(self) -> None:
        """A group marked dispatched whose request no worker link holds can never complete."""
        live = {tag for w in self.workers.values() for tag in w.requests.values()}
        for group in list(self.scheduler.groups.values()):
            if group.status is GroupStatus.DISPATCHED and group.request_id not in live:
                log.warning("group %d had no live request; back to the queue", group.index)
                self.scheduler.release(group)

    def _follow_moves(self, now: float) -> None:
        """A worker restarted on another node listens at a new address (the launcher's address
        book): its requests go back to the queue and its link connects there."""
        if self._book is None or now - self._book_read < self.config.controller.heartbeat_interval_s:
            return
        self._book_read = now
        entries = self._book.entries()
        for worker in self.workers.values():
            address = entries.get(worker.name, worker.link.address)
            if address == worker.link.address:
                continue
            log.warning("%s moved: %s -> %s", worker.name, worker.link.address, address)
            self._declare_dead(worker, f"moved to {address}", reopen=False)
            worker.link.retarget(address)
            worker.pings.clear()
            worker.last_ping = 0.0  # say Hello there now

    def _heartbeat(self, now: float) -> None:
        cfg = self.config.controller
        self._release_orphans()
        self._follow_moves(now)
        for worker in self.workers.values():
            if now - worker.last_ping >= cfg.heartbeat_interval_s:
                worker.last_ping = now
                request_id = worker.link.hello()
                if request_id is not None:
                    worker.pings.add(request_id)
            for request_id, sent in list(worker.sent_at.items()):
                if now - sent > cfg.request_timeout_s:
                    tag = worker.requests.pop(request_id, None)
                    del worker.sent_at[request_id]
                    if tag is not None:
                        log.warning(
                            "%s: request %s timed out after %.1fs; reassigning", worker.name, tag, now - sent
                        )
                        self.scheduler.counters["requests_timed_out"] = (
                            self.scheduler.counters.get("requests_timed_out", 0) + 1
                        )
                        self._release_tag(worker, tag)
                        # A worker that answers pings but not requests is hung: keep work away from it.
                        worker.timeouts += 1
                        worker.quarantine_until = now + min(
                            60.0, cfg.request_timeout_s * 2 ** (worker.timeouts - 1)
                        )
            silent = now - worker.last_seen
            if worker.alive and silent > cfg.heartbeat_timeout_s:
                self._declare_dead(
                    worker,
                    f"silent for {silent:.1f}s (controller.heartbeat_timeout_s={cfg.heartbeat_timeout_s})",
                )

    def _on_welcome(self, worker: WorkerState, welcome: Welcome, now: float) -> None:
        if (
            worker.link.server_id is not None
            and welcome.server_id != worker.link.server_id
            and worker.requests
        ):
            # The worker restarted: requests sent to its previous life are lost.
            self._declare_dead(
                worker, f"restarted (server id {worker.link.server_id} -> {welcome.server_id})", reopen=False
            )
        worker.link.server_id = welcome.server_id
        if not worker.alive:
            self.metrics.write(
                {"kind": "worker", "step": self.scheduler.step, "worker": worker.name, "event": "alive"}
            )
        worker.alive = True
        worker.last_seen = now

    def _poll_workers(self, now: float) -> None:
        for worker in self.workers.values():
            try:
                replies = worker.link.receive()
            except ProtocolError as error:
                self._declare_dead(worker, f"protocol error: {error}")
                continue
            for request_id, message in replies:
                worker.last_seen = now
                worker.pings.discard(request_id)
                tag = worker.requests.pop(request_id, None)
                worker.sent_at.pop(request_id, None)
                try:
                    self._on_reply(worker, tag, message, now)
                except ConfigError:
                    raise  # the run's config, not the reply, is wrong: stop the run
                except Exception as error:  # one bad reply must not stop the controller
                    log.error(
                        "%s: dropped its %s to request %s: %s",
                        worker.name,
                        type(message).__name__,
                        tag,
                        _describe(error),
                        exc_info=not isinstance(error, MalformedMessageError),
                    )
                    self._count("bad_worker_replies")
                    if tag is not None:
                        self._release_tag(worker, tag)

    def _on_reply(self, worker: WorkerState, tag: str | None, message: Message, now: float) -> None:
        """One reply of `worker`; `tag`: the request it answers (None: none we sent or still track)."""
        if isinstance(message, Welcome):
            self._on_welcome(worker, message, now)
        elif isinstance(message, GenerateResult):
            if message.request_id != tag:
                # Late (its request timed out and was reassigned) or answering a request it
                # was never sent: either way it must not complete anyone's group.
                log.warning("%s: ignored a result for %r on request %s", worker.name, message.request_id, tag)
                self._count("results_ignored")
                if tag is not None:
                    self._release_tag(worker, tag)
                return
            _check_result(message)
            worker.timeouts = 0
            self._on_result(worker, message)
        elif isinstance(message, ErrorReply):
            log.error("%s refused request %s: %s %s", worker.name, tag, message.code, message.message)
            if tag is not None:
                self._release_tag(worker, tag)
        else:
            raise MalformedMessageError(f"a worker does not answer with {type(message).__name__}")

    def _count(self, name: str) -> None:
        self.scheduler.counters[name] = self.scheduler.counters.get(name, 0) + 1

    def _release_tag(self, worker: WorkerState, tag: str) -> None:
        group = self.scheduler.group_for_request(tag)
        if group is not None:
            self.scheduler.release(group)
        elif self.eval_job is not None:
            for index, status in self.eval_job.status.items():
                if status == tag:
                    self.eval_job.status[index] = "pending"

    def _on_result(self, worker: WorkerState, result: GenerateResult) -> None:
        if worker.version is not None and result.weight_version != worker.version:
            worker.reloads += 1
            self.metrics.write(
                {
                    "kind": "worker",
                    "step": self.scheduler.step,
                    "worker": worker.name,
                    "event": "version",
                    "from_version": worker.version,
                    "to_version": result.weight_version,
                }
            )
        worker.version = result.weight_version
        worker.stats = result.stats or worker.stats
        lag = self.scheduler.step - result.weight_version
        if not self.scheduler.pinned and lag > self.config.workers.j + self.config.trainer.k + 1:
            # It should have reloaded long ago (its weight puller is stuck): keep work away.
            log.warning(
                "%s generates with version %d, %d behind step %d: quarantined",
                worker.name,
                result.weight_version,
                lag,
                self.scheduler.step,
            )
            self.scheduler.counters["stale_worker_results"] = (
                self.scheduler.counters.get("stale_worker_results", 0) + 1
            )
            worker.quarantine_until = time.monotonic() + self.config.controller.request_timeout_s
        # A trajectory's final answer is its last model turn; its generated tokens, the model's.
        completions = [last_model_turn(s.token_ids, s.model_mask) for s in result.samples]
        self._rate_tokens += sum(
            sum(s.model_mask) if s.model_mask else len(s.token_ids) for s in result.samples
        )
        if result.request_id.startswith("eval"):
            self._on_eval_result(result, completions)
            return
        group = self.scheduler.group_for_request(result.request_id)
        if group is None:
            self.scheduler.counters["results_ignored"] += 1
            return
        if group.pinned is not None and result.weight_version != group.pinned:
            log.error(
                "%s generated %s with version %d, asked for %d; the group goes back to the queue",
                worker.name,
                result.request_id,
                result.weight_version,
                group.pinned,
            )
            self._count("wrong_version_results")
            self.scheduler.release(group)
            return
        try:
            with self._timed("controller_score_seconds"):
                scores = self._score(group.item, completions)
        except (ProtocolError, TimeoutError) as error:
            # A verifier service that is down: generate this group again later.
            log.error("scoring %s failed (%s); the group goes back to the queue", result.request_id, error)
            self.scheduler.counters["scoring_failures"] = (
                self.scheduler.counters.get("scoring_failures", 0) + 1
            )
            self.scheduler.release(group)
            return
        samples = [
            ScoredSample(
                tuple(s.token_ids),
                tuple(s.logprobs),
                s.finish_reason,
                float(r) if s.env_reward is None else s.env_reward,
                bool(c),
                model_mask=tuple(s.model_mask),
                turns=s.turns,
                tool_calls=s.tool_calls,
                tool_errors=s.tool_errors,
                end=s.end,
            )
            for s, (r, c) in zip(result.samples, scores, strict=True)
        ]
        try:
            self.scheduler.complete(result.request_id, result.weight_version, samples)
        except ValueError as error:  # a worker that answered with the wrong number of samples
            log.error("%s: %s; the group goes back to the queue", worker.name, error)
            self.scheduler.release(group)

    def _score(self, item: PromptItem, completions: list[tuple[int, ...]]) -> list[tuple[float, bool]]:
        """The scorer's rewards; a verifier service without a route for the item's task
        stops the run with a config error, since no retry could score it."""
        try:
            return self.scorer.score(item, completions)
        except RemoteError as error:
            if error.code == "not_found":
                raise ConfigError(
                    f"verifier: the verifier service cannot score this run's task: {error}"
                ) from None
            raise

    def _on_eval_result(self, result: GenerateResult, completions: list[tuple[int, ...]]) -> None:
        job = self.eval_job
        if job is None:
            return
        index = next((i for i, s in job.status.items() if s == result.request_id), None)
        if index is None:
            return
        try:
            job.results[index] = self._score(job.items[index], completions)
        except (ProtocolError, TimeoutError) as error:
            log.error("scoring evaluation prompt %d failed (%s); it will be generated again", index, error)
            job.status[index] = "pending"
            return
        job.versions[index] = result.weight_version
        job.samples[index] = result.samples
        job.status[index] = "done"
        if all(s == "done" for s in job.status.values()):
            self._finish_eval(job)

    # ------------------------------------------------------------------ main loop
    def run(self, *, stop_after_complete_s: float = 2.0, max_seconds: float | None = None) -> int:
        """Serve until the trainer has been told the run is complete; returns an exit code."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        for worker in self.workers.values():
            assert worker.link.socket is not None
            poller.register(worker.link.socket, zmq.POLLIN)
        started = time.monotonic()
        completed_at: float | None = None
        while True:
            now = time.monotonic()
            if max_seconds is not None and now - started > max_seconds:
                raise TimeoutError(f"controller ran longer than {max_seconds}s")
            self._serve_router()
            self._poll_workers(now)
            self._heartbeat(now)
            if self.restored:
                self._dispatch(now)
            self._answer_held(now)
            if self.complete_replied:
                completed_at = completed_at or now
                if now - completed_at > stop_after_complete_s:
                    return 0
            # Sockets are re-created when a worker is declared dead; rebuild the poll set.
            poller = zmq.Poller()
            poller.register(self.router, zmq.POLLIN)
            for worker in self.workers.values():
                if worker.link.socket is not None:
                    poller.register(worker.link.socket, zmq.POLLIN)
            poller.poll(20)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.link.close()
        self.router.close(linger=0)
        self.auth.close()
        self.metrics.close()
