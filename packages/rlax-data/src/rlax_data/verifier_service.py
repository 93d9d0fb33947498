"""`VerifierService`: the verifier service's request handling (admission, fair turns on
the serving thread, the code and environment pools, deferred replies). The wire format
is `rlax_data.verifier_wire`, the scoring `rlax_data.verifier_scoring`, environment
steps `rlax_data.verifier_env_steps`; `rlax_data.verifier_process` is the command line."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, InvalidStateError

import zmq

import rlax_protocol as rp
from rlax_data.envs.remote import EnvStepServer
from rlax_data.verifier_env_steps import env_step_job
from rlax_data.verifier_scoring import Plan, RouteScorer, build_reply, plan_message
from rlax_data.verifier_wire import (
    DEFAULT_ADDRESS,
    MAX_BATCH_BYTES,
    MAX_BATCH_ITEMS,
    RETRY_AFTER_S,
    BadRequest,
    capped,
    describe,
)
from rlax_data.verify.base import VerifyItem, VerifyResult
from rlax_data.verify.registry import RoutingVerifier, sandbox_of
from rlax_protocol.auth import Permissions, roles
from rlax_protocol.rpc_server import BatchResult

log = logging.getLogger("rlax_data.verifier_process")  # the service's log lines keep the name they had

_FIRST_ITEM_COST_S = 0.002
"""What an item of a route not timed yet is assumed to cost the main thread."""
_MAX_TURN_ITEMS = 4096


class Job:
    """One verification message's work: its items that were not refused on arrival, their
    results as they come, and the future its reply is sent from. `cheap` items are scored
    on the serving thread (`next` of them so far), then the `slow` ones (a sandboxed
    route's) in the code pool."""

    __slots__ = ("cheap", "client", "future", "items", "next", "plan", "results", "slow")

    def __init__(
        self, plan: Plan, items: list[VerifyItem], client: bytes, slow_routes: Collection[str]
    ) -> None:
        self.plan = plan
        self.items = items
        self.client = client
        self.results: list[VerifyResult | Exception | None] = [None] * len(items)
        if slow_routes:
            self.slow = [i for i, (_, record) in enumerate(items) if record.task in slow_routes]
        else:
            self.slow = []
        if self.slow:
            slow = set(self.slow)
            self.cheap = [i for i in range(len(items)) if i not in slow]
        else:
            self.cheap = list(range(len(items)))
        self.next = 0
        self.future: Future[BatchResult] = Future()


VERIFIER_PERMISSIONS: Permissions = {
    rp.VerifyBatch: roles("controller"),
    rp.VerifyRequest: roles("controller"),
    rp.EnvStepRequest: roles("controller", "worker"),
}
"""Who may ask the verifier service what, when the run authenticates (`rlax_protocol.auth`):
the controller scores, the workers (and the controller) step environments."""


class VerifierService:
    """`rlax_protocol.RpcServer` with a batch handler that scores `VerifyRequest`s.

    It binds when built (`bound_address` is then known); `serve()` answers requests
    in the calling thread until `stop()` (or SIGTERM/SIGINT via `main`); `close()`
    releases the socket.

    Within a message, items are scored one verifier route at a time, so a record one
    route refuses cannot make another route's programs run again. Within a route, a batch
    that raises is split in halves until each refused record stands alone: the refused
    record gets an error, and the rest are scored in the largest batches that succeed.
    Verifiers check every record of a batch before they run anything (the code verifier
    builds all its jobs before it starts the sandbox), so a refused batch has run no
    program and no program runs twice.

    Where the work runs, so that one client's slow work delays no one else's:

    * Items of routes that run no program (exact match, math, Countdown) are scored on the
      serving thread (math's timeout uses signals), in slices of about `slice_s` between
      receives, the clients taking turns (`rlax_protocol.FairQueue`); each turn takes as
      many of a client's waiting items, across its messages, as the time each route's
      items took so far says fit in half a slice. The longest one item may hold the
      thread is the verifier's own limit (math-verify's `timeout_s`).
    * Items of sandboxed routes (`registry.sandbox_of`) run in `code_threads` threads
      that wait on the sandbox's subprocesses, and environment steps in `env_threads`;
      each pool takes its clients in turn and runs at most half its threads for any one
      client (`rlax_protocol.FairPool`).
    * Every reply is sent by the serving thread when its work is done (a deferred reply).

    Limits a client cannot raise. Sizes and counts are refused when exceeded, with an error
    that names the limit and the value: a message's bytes (`max_request_bytes`,
    ``too_large``), a batch's items (`max_items`, ``too_large``), an environment step's
    turns (`max_env_turns`, ``too_large``), and the messages one client
    (`max_pending_per_client`) or all clients together (`max_pending`) may have waiting
    or running (``busy``, naming the wait to retry after). Timeouts are clamped instead:
    a run's own clients ask for theirs from settings the service does not see
    (`RemoteVerifier`'s `sandbox_timeout_s`, `agent.tool_timeout_s`), and refusing would
    fail every request of a run set above the service. A sandboxed job runs at most its
    route's `sandbox.timeout_s`, whatever its request or its record ask (its result says
    "timed out after" that), and an environment step at most `max_timeout_s` (its
    ``timeout`` error names both that and what was asked).
    """

    def __init__(
        self,
        verifier: RoutingVerifier,
        *,
        address: str = DEFAULT_ADDRESS,
        max_batch: int = 256,
        batch_window_s: float = 0.0,
        poll_s: float = 0.2,
        server_id: str = "rlax-verifier",
        max_items: int = MAX_BATCH_ITEMS,
        max_request_bytes: int = MAX_BATCH_BYTES,
        env_threads: int = 8,
        env_paths: Sequence[str] = (),
        code_threads: int = 2,
        max_timeout_s: float = 60.0,
        max_env_turns: int = rp.MAX_ENV_TURNS,
        max_pending_per_client: int = 64,
        max_pending: int = 4096,
        slice_s: float = 0.1,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        for name, value in (
            ("code_threads", code_threads),
            ("env_threads", env_threads),
            ("max_timeout_s", max_timeout_s),
            ("max_env_turns", max_env_turns),
            ("max_pending_per_client", max_pending_per_client),
            ("max_pending", max_pending),
            ("slice_s", slice_s),
        ):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        self.verifier = verifier
        # Multi-turn environments run here for the workers (`agent.where: service`).
        self.envs = EnvStepServer(threads=env_threads, allowed_paths=env_paths)
        self.max_items = max_items
        self.max_timeout_s = max_timeout_s
        self.max_env_turns = max_env_turns
        self.max_pending_per_client = max_pending_per_client
        self.max_pending = max_pending
        self.slice_s = slice_s
        self.poll_s = poll_s
        self.stats = {"requests": 0, "items": 0, "batches": 0, "errors": 0, "internal_errors": 0, "busy": 0}
        # The most a sandboxed route's job may run, by route; those routes run in the pool.
        self._ceilings = {
            name: config.timeout_s
            for name, route in verifier.routes.items()
            if (config := sandbox_of(route)) is not None
        }
        self._main: rp.FairQueue[Job] = rp.FairQueue()
        self._code = rp.FairPool(code_threads, name="rlax-verifier-code")
        self._env = rp.FairPool(env_threads, name="rlax-verifier-env")
        self._scorer = RouteScorer(verifier.routes)  # on the serving thread, and the code pool's
        self._lock = threading.Lock()
        self._pending: collections.Counter[bytes] = collections.Counter()
        self.server = rp.RpcServer(
            address,
            batch_handler=self._handle,
            max_batch=max_batch,
            batch_window_s=batch_window_s,
            max_request_bytes=max_request_bytes,
            poll_s=poll_s,
            server_id=server_id,
            permissions=VERIFIER_PERMISSIONS,
            with_peer=True,
            main_work=self._work,
        )
        self.bound_address: str = self.server.listen()

    def stop(self) -> None:
        """Make `serve()` return (within `poll_s`); safe from a signal handler."""
        self.server.shutdown()

    def close(self) -> None:
        self.server.stop()
        for job in self._main.clear():
            job.future.cancel()
        self._code.close()
        self._env.close()
        self.envs.close()

    def serve(self) -> None:
        """Serve in the calling thread until `stop()`; verifiers that use signals (math
        with a timeout) need this to be the main thread."""
        self.server.serve_forever()

    # -- the batch handler

    def _handle(self, batch: list[tuple[rp.Message, list[zmq.Frame], bytes]]) -> list[BatchResult]:
        """One reply, error or future of a reply per message, in order; nothing slow runs here."""
        out: list[BatchResult] = []
        verifying = 0
        for message, frames, client in batch:
            if not isinstance(message, rp.EnvStepRequest):
                verifying += 1
            try:
                out.append(self._admit(message, frames, client))
            except BadRequest as e:
                self.stats["errors"] += 1
                self.stats["busy"] += e.code == "busy"
                out.append(rp.RemoteError(e.code, str(e)))
            except Exception as e:  # one message must never cost the others their answers
                self.stats["internal_errors"] += 1
                log.error("reading a request failed: %s", describe(e), exc_info=e)
                out.append(rp.RemoteError("internal", describe(e)))
        if verifying:
            self.stats["requests"] += verifying
            self.stats["batches"] += 1
        return out

    def _admit(self, message: rp.Message, frames: list[zmq.Frame], client: bytes) -> Future[BatchResult]:
        """Queue a message's work (within the client's share); the future of its reply."""
        with self._lock:
            mine, everyone = self._pending[client], sum(self._pending.values())
        if mine >= self.max_pending_per_client:
            raise BadRequest(
                "busy",
                f"this client has {mine} requests waiting or running (the service's "
                f"max_pending_per_client={self.max_pending_per_client}); retry after {RETRY_AFTER_S:g}s",
            )
        if everyone >= self.max_pending:
            raise BadRequest(
                "busy",
                f"the service has {everyone} requests waiting or running (max_pending="
                f"{self.max_pending}); retry after {RETRY_AFTER_S:g}s",
            )
        if isinstance(message, rp.EnvStepRequest):
            step = env_step_job(
                self.envs, message, frames, max_env_turns=self.max_env_turns, max_timeout_s=self.max_timeout_s
            )
            future = self._env.submit(client, step)
        else:
            items: list[VerifyItem] = []
            plan = plan_message(message, frames, items, self.verifier.routes, self.max_items)
            self.stats["items"] += len(items)
            self._bound(items)
            job = Job(plan, items, client, self._ceilings)
            if job.cheap:
                self._main.put(client, job)
            else:
                self._run_slow(job)
            future = job.future
        with self._lock:
            self._pending[client] += 1
        future.add_done_callback(lambda _: self._release(client))
        return future

    def _release(self, client: bytes) -> None:
        with self._lock:
            self._pending[client] -= 1
            if self._pending[client] <= 0:
                del self._pending[client]

    def _bound(self, items: list[VerifyItem]) -> None:
        """Cap every sandboxed job at its route's timeout, whatever its request asked."""
        if not self._ceilings:
            return
        for n, (completion, record) in enumerate(items):
            if record.tests is not None and (ceiling := self._ceilings.get(record.task or "")) is not None:
                items[n] = (completion, capped(record, ceiling))

    # -- scoring

    def _work(self) -> bool:
        """Score on the serving thread for about `slice_s`, the clients taking turns;
        whether more waits. Called by the server's loop between receives."""
        deadline = time.monotonic() + self.slice_s
        while time.monotonic() < deadline:
            client = self._main.turn()
            if client is None:
                return False
            self._score_turn(self._main.waiting(client))
        return bool(self._main)

    def _score_turn(self, queue: collections.deque[Job]) -> None:
        """Score the next of one client's waiting items, as many as fit in half a slice."""
        budget = self.slice_s / 2
        taken: list[tuple[Job, int]] = []
        cost = 0.0
        for job in queue:
            while job.next < len(job.cheap) and (cost < budget or not taken) and len(taken) < _MAX_TURN_ITEMS:
                i = job.cheap[job.next]
                job.next += 1
                taken.append((job, i))
                cost += self._scorer.cost.get(job.items[i][1].task or "", _FIRST_ITEM_COST_S)
            if job.next < len(job.cheap):
                break
        try:
            results = self._scorer.verify([job.items[i] for job, i in taken])
        except Exception as e:  # not one item's fault (`verify` catches those): answer all
            self.stats["internal_errors"] += 1
            log.error("scoring a batch failed: %s", describe(e), exc_info=e)
            results = [e] * len(taken)
        for (job, i), result in zip(taken, results, strict=True):
            job.results[i] = result
        while queue and queue[0].next == len(queue[0].cheap):
            job = queue.popleft()
            if job.slow:
                self._run_slow(job)
            else:
                self._answer(job)

    def _run_slow(self, job: Job) -> None:
        """Score the job's sandboxed items in the code pool, then answer it from there."""

        def run() -> None:
            slow = self._scorer.verify([job.items[i] for i in job.slow])
            for i, result in zip(job.slow, slow, strict=True):
                job.results[i] = result
            self._answer(job)

        def check(ran: Future[None]) -> None:
            if ran.cancelled():
                job.future.cancel()
            elif (error := ran.exception()) is not None:
                settle_reply(job.future, rp.RemoteError("internal", describe(error)))

        self._code.submit(job.client, run).add_done_callback(check)

    def _answer(self, job: Job) -> None:
        try:
            reply = build_reply(job.plan, job.results, self.stats)  # type: ignore[arg-type]  # all scored
        except Exception as e:
            self.stats["internal_errors"] += 1
            log.error("building a reply failed: %s", describe(e), exc_info=e)
            reply = rp.RemoteError("internal", describe(e))
        settle_reply(job.future, reply)


def settle_reply(future: Future[BatchResult], reply: BatchResult) -> None:
    try:
        future.set_result(reply)
    except InvalidStateError:  # cancelled: the service is closing
        pass
