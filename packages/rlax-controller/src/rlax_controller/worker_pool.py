"""The controller's inference workers: one request link each, their liveness (heartbeats,
silence, restarts, moves to another node), the requests each holds, and their replies.

The pool knows requests only by their tag (the `GenerateRequest.request_id`); what the
work is, and what becomes of it when a request or a worker is lost, is its `WorkOwner`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import zmq

from rlax_controller.error_text import describe_error
from rlax_controller.metrics import MetricsWriter
from rlax_controller.rollout_scheduler import RolloutScheduler
from rlax_controller.run_tally import RunTally
from rlax_core.addresses import AddressBook
from rlax_core.config import ConfigError, RunConfig
from rlax_protocol.errors import MalformedMessageError, ProtocolError
from rlax_protocol.messages import ErrorReply, GenerateRequest, GenerateResult, Message, Welcome, WorkerStats
from rlax_protocol.messages import decode as decode_protocol
from rlax_protocol.messages import encode as encode_protocol
from rlax_protocol.request_links import PeerLink

__all__ = ["WorkOwner", "WorkerPool", "WorkerState", "check_result"]

log = logging.getLogger("rlax.controller")
# The tags a worker may still answer after they timed out on it, kept to recognise a late
# answer (a slow worker, not a hung one); a bound, as a worker may time out without end.
MAX_TIMED_OUT_TAGS = 4096


class WorkOwner(Protocol):
    """Whose work the pool's requests carry: given each result, told of each lost request."""

    def take_result(self, worker: str, result: GenerateResult) -> None:
        """A well-formed result `worker` sent for a request it was sent and still holds."""

    def release(self, tag: str) -> None:
        """The request `tag` will never be answered: its work goes back to the queue."""

    def worker_lost(self, worker: str, tags: Collection[str]) -> None:
        """`worker` is declared dead with the requests `tags` outstanding."""


@dataclasses.dataclass
class WorkerState:
    name: str
    link: PeerLink
    alive: bool = False
    last_seen: float = 0.0
    last_ping: float = 0.0
    requests: dict[int, str] = dataclasses.field(default_factory=dict)  # link request id -> tag
    pings: set[int] = dataclasses.field(default_factory=set)
    sent_at: dict[int, float] = dataclasses.field(default_factory=dict)
    timeouts: int = 0
    quarantine_until: float = 0.0
    answered: bool = False  # any result in this life: its first compilation is behind it
    timed_out: set[str] = dataclasses.field(default_factory=set)  # tags it may still answer late
    version: int | None = None
    reloads: int = 0
    stats: WorkerStats | None = None  # the totals its latest result carried


def check_result(result: GenerateResult) -> None:
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


class WorkerPool:
    """Workers `worker0`, `worker1`, ... at `addresses`. `scheduler` is only read: the step
    (for the worker records) and whether versions are pinned (for stale-worker checks)."""

    def __init__(
        self,
        config: RunConfig,
        addresses: Sequence[str],
        *,
        context: zmq.Context[Any],
        owner: WorkOwner,
        scheduler: RolloutScheduler,
        metrics: MetricsWriter,
        tally: RunTally,
    ) -> None:
        self.config = config
        self.owner = owner
        self.scheduler = scheduler
        self.metrics = metrics
        self.tally = tally
        self.workers = {
            f"worker{i}": WorkerState(
                f"worker{i}",
                PeerLink(
                    address,
                    encode=encode_protocol,
                    decode=decode_protocol,
                    context=context,
                    role="controller",
                ),
            )
            for i, address in enumerate(addresses)
        }
        # Where the launcher says each worker listens now (a worker moved to another node).
        self._book = AddressBook(config.addresses.book) if config.addresses.book else None
        self._book_read = 0.0

    # -- what the other parts read ---------------------------------------------------------
    def sockets(self) -> list[zmq.Socket[Any]]:
        """The links' sockets now (a link is re-created when its worker is declared dead)."""
        return [w.link.socket for w in self.workers.values() if w.link.socket is not None]

    def ready(self, now: float) -> list[WorkerState]:
        """The workers that may be sent work: alive and not quarantined."""
        return [w for w in self.workers.values() if w.alive and now >= w.quarantine_until]

    def alive_count(self) -> int:
        return sum(w.alive for w in self.workers.values())

    def inflight(self) -> int:
        return sum(len(w.requests) for w in self.workers.values())

    def live_tags(self) -> set[str]:
        return {tag for w in self.workers.values() for tag in w.requests.values()}

    def stats(self) -> dict[str, WorkerStats | None]:
        return {name: w.stats for name, w in self.workers.items()}

    # -- requests ----------------------------------------------------------------------------
    def send(self, worker: WorkerState, request: GenerateRequest) -> bool:
        """False: the worker's link is not connected (nothing was sent)."""
        request_id = worker.link.send(request)
        if request_id is None:
            return False
        worker.requests[request_id] = request.request_id
        worker.sent_at[request_id] = time.monotonic()
        return True

    def forget_requests(self) -> None:
        """Stop waiting for every request (the run went back to a snapshot): late answers are ignored."""
        for worker in self.workers.values():
            worker.requests.clear()
            worker.sent_at.clear()

    def declare_dead(self, worker: WorkerState, why: str, *, reopen: bool = True) -> None:
        if worker.alive or worker.requests:
            log.warning("%s declared dead: %s", worker.name, why)
            self._write_event(worker, "dead", why=why)
        worker.alive = False
        self.owner.worker_lost(worker.name, list(worker.requests.values()))
        worker.requests.clear()
        worker.sent_at.clear()
        if reopen:
            worker.link.open()  # drop whatever was queued for the dead peer
            worker.pings.clear()

    def _write_event(self, worker: WorkerState, event: str, **fields: Any) -> None:
        self.metrics.write(
            {"kind": "worker", "step": self.scheduler.step, "worker": worker.name, "event": event, **fields}
        )

    # -- heartbeats --------------------------------------------------------------------------
    def heartbeat(self, now: float) -> None:
        """Follows moved workers, pings each every heartbeat interval, times out requests
        (quarantining a worker that answers pings but not requests) and declares silent
        workers dead."""
        cfg = self.config.controller
        self._follow_moves(now)
        for worker in self.workers.values():
            if now - worker.last_ping >= cfg.heartbeat_interval_s:
                worker.last_ping = now
                request_id = worker.link.hello()
                if request_id is not None:
                    worker.pings.add(request_id)
            self._time_out_requests(worker, now)
            silent = now - worker.last_seen
            if worker.alive and silent > cfg.heartbeat_timeout_s:
                self.declare_dead(
                    worker,
                    f"silent for {silent:.1f}s (controller.heartbeat_timeout_s={cfg.heartbeat_timeout_s})",
                )

    def _time_out_requests(self, worker: WorkerState, now: float) -> None:
        """Sends `worker`'s overdue requests elsewhere; a worker that answers pings but not
        requests is hung, so work is kept away from it, longer at each further strike. All
        the requests that ran out together are one strike (one hang, not one per request)."""
        cfg = self.config.controller
        limit = (
            cfg.request_timeout_s
            if worker.answered
            else max(cfg.request_timeout_s, cfg.first_result_timeout_s)
        )
        struck = False
        for request_id, sent in list(worker.sent_at.items()):
            if now - sent <= limit:
                continue
            tag = worker.requests.pop(request_id, None)
            del worker.sent_at[request_id]
            if tag is None:
                continue
            log.warning("%s: request %s timed out after %.1fs; reassigning", worker.name, tag, now - sent)
            self.tally.count("requests_timed_out")
            self.owner.release(tag)
            if len(worker.timed_out) < MAX_TIMED_OUT_TAGS:
                worker.timed_out.add(tag)
            struck = True
        if struck:
            worker.timeouts += 1
            worker.quarantine_until = now + min(60.0, cfg.request_timeout_s * 2 ** (worker.timeouts - 1))

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
            self.declare_dead(worker, f"moved to {address}", reopen=False)
            worker.link.retarget(address)
            worker.pings.clear()
            worker.last_ping = 0.0  # say Hello there now

    # -- replies -----------------------------------------------------------------------------
    def poll(self, now: float) -> None:
        """Takes every reply the workers have sent; one bad reply costs only its request."""
        for worker in self.workers.values():
            try:
                replies = worker.link.receive()
            except ProtocolError as error:
                self.declare_dead(worker, f"protocol error: {error}")
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
                        describe_error(error),
                        exc_info=not isinstance(error, MalformedMessageError),
                    )
                    self.tally.count("bad_worker_replies")
                    if tag is not None:
                        self.owner.release(tag)

    def _on_reply(self, worker: WorkerState, tag: str | None, message: Message, now: float) -> None:
        """One reply of `worker`; `tag`: the request it answers (None: none we sent or still track)."""
        if isinstance(message, Welcome):
            self._on_welcome(worker, message, now)
        elif isinstance(message, GenerateResult):
            if message.request_id != tag:
                # Late (its request timed out and was reassigned) or answering a request it
                # was never sent: either way it must not complete anyone's group.
                log.warning("%s: ignored a result for %r on request %s", worker.name, message.request_id, tag)
                self.tally.count("results_ignored")
                if tag is not None:
                    self.owner.release(tag)
                if message.request_id in worker.timed_out:
                    # It answers what timed out: slow (a compilation), not hung. Its quarantine ends.
                    self._answered(worker, now)
                    worker.quarantine_until = 0.0
                return
            check_result(message)
            self._answered(worker, now)
            self._note_version(worker, message)
            self.owner.take_result(worker.name, message)
        elif isinstance(message, ErrorReply):
            log.error("%s refused request %s: %s %s", worker.name, tag, message.code, message.message)
            if tag is not None:
                self.owner.release(tag)
        else:
            raise MalformedMessageError(f"a worker does not answer with {type(message).__name__}")

    @staticmethod
    def _answered(worker: WorkerState, now: float) -> None:
        """`worker` answered a request: not hung. Its first answer of a life ends its first
        compilation, so the requests it holds get `request_timeout_s` from now, not from
        when they were sent into that compilation."""
        if not worker.answered:
            for request_id, sent in worker.sent_at.items():
                worker.sent_at[request_id] = max(sent, now)
        worker.answered = True
        worker.timed_out.clear()
        worker.timeouts = 0

    def _on_welcome(self, worker: WorkerState, welcome: Welcome, now: float) -> None:
        if (
            worker.link.server_id is not None
            and welcome.server_id != worker.link.server_id
            and worker.requests
        ):
            # The worker restarted: requests sent to its previous life are lost.
            self.declare_dead(
                worker, f"restarted (server id {worker.link.server_id} -> {welcome.server_id})", reopen=False
            )
        if welcome.server_id != worker.link.server_id:
            worker.answered = False  # a new life compiles again
            worker.timed_out.clear()
        worker.link.server_id = welcome.server_id
        if not worker.alive:
            self._write_event(worker, "alive")
        worker.alive = True
        worker.last_seen = now

    def _note_version(self, worker: WorkerState, result: GenerateResult) -> None:
        """The weights `worker` generates with; one far behind the run is quarantined."""
        if worker.version is not None and result.weight_version != worker.version:
            worker.reloads += 1
            self._write_event(
                worker, "version", from_version=worker.version, to_version=result.weight_version
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
            self.tally.count("stale_worker_results")
            worker.quarantine_until = time.monotonic() + self.config.controller.request_timeout_s

    def close(self) -> None:
        for worker in self.workers.values():
            worker.link.close()
