"""`rlax-verifier`: verification as a ZeroMQ service, so scoring scales out to other hosts.

Wire format: the `rlax_protocol` request/reply framing (DEALER client -> ROUTER server),
served by `rlax_protocol.RpcServer` with a batch handler. A client says `Hello`, then
sends either

* a batch (what `RemoteVerifier` sends): a `VerifyBatch` header (`items`: how many),
  followed by one raw frame holding the JSON array of ``[completion, record]`` pairs
  (a `Record` as JSON; its `task` names the verifier route). The reply is a
  `VerifyBatchResult` header (`refused`: how many items were not scored) followed by one
  raw frame holding the JSON array of per-item outcomes ``[reward, correct, details,
  code, error]`` (trailing defaults left out; a non-empty ``code`` means that item was
  refused and says why);
* or single `VerifyRequest`s, pipelined, each answered with its own `VerifyResult`
  (or `ErrorReply`);
* or `EnvStepRequest`s, the workers' multi-turn environment steps (`agent.where:
  service`), each answered with an `EnvStepResult` (see `rlax_data.envs.remote`).

One message per item cost a round of encode, bounds check, decode and a socket hop
per completion, about 40x the in-process cost of an exact match; a batch costs one.
Each time the server wakes it drains the messages already waiting (up to
`max_batch`); a client's waiting items are scored together, one batch per verifier
route, as many at a time as its turn allows, and a message's sandboxed items run as
one batch, so the code sandbox runs its programs in parallel. An item whose record is
malformed, names no served route, or is refused by its verifier fails alone (see
`VerifierService`); a message that cannot be read at all gets an `ErrorReply`. No
message, however hostile, stops the server, and every receive has a timeout.

How a single `VerifyRequest` maps onto a record: `verifier` picks the route (it
becomes the record's `task`); `extra["record"]`, when present, is a JSON-encoded
`Record` (tests for code, numbers and target for Countdown); otherwise the record is
built from `reference` (the answer) and `extra["metadata"]` (a JSON object), if given.
A request's (or a batch's) `timeout_s` caps each sandboxed job of its records.

What a client asks for is bounded by the service, not the client: see `VerifierService`
for each limit, and for how one client's slow work (sandboxed programs, environment
steps, a long batch) is kept from delaying another's.
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

import msgspec
import yaml
import zmq

import rlax_protocol as rp
from rlax_data.datasets import Record
from rlax_data.envs.remote import EnvStepServer
from rlax_data.verify.answers import ExactMatchConfig, MathConfig
from rlax_data.verify.base import Verifier, VerifyItem, VerifyResult
from rlax_data.verify.code import CodeConfig
from rlax_data.verify.countdown import CountdownConfig
from rlax_data.verify.registry import (
    RoutingConfig,
    RoutingVerifier,
    build_verifier,
    load_verifier_config,
    sandbox_of,
)
from rlax_protocol.auth import Permissions, roles
from rlax_protocol.rpc_server import BatchResult

__all__ = ["RemoteVerifier", "VerifierService", "default_routes", "main"]

log = logging.getLogger("rlax_data.verifier_process")

DEFAULT_ADDRESS = "tcp://127.0.0.1:5599"
"""The `VerifyRequest.verifier` of a batch header (never a route name: routes may not start with @)."""
MAX_BATCH_ITEMS = 65_536
"""Most items one batch message may hold."""
MAX_BATCH_BYTES = 32 * 1024 * 1024
"""Most bytes one request (header and frames) may hold."""
_COUNT_FIRST_BYTES = 1 << 20
RETRY_AFTER_S = 1.0
"""The wait a ``busy`` answer suggests before the request is sent again."""
_FIRST_ITEM_COST_S = 0.002
"""What an item of a route not timed yet is assumed to cost the main thread."""
_MAX_TURN_ITEMS = 4096


def default_routes() -> RoutingConfig:
    """Routes served when no config is given: the general verifiers, and every built-in task
    under its name with the verifier the task itself uses (so a run scores the same with
    `verifier.mode: local` and `service`)."""
    from rlax_data.tasks import TASK_NAMES, make_task

    general: dict[str, Any] = {
        "math": MathConfig(),
        "exact_match": ExactMatchConfig(),
        "countdown": CountdownConfig(),
        "code": CodeConfig(),
    }
    tasks = {name: make_task(name).verifier().config for name in TASK_NAMES}
    return RoutingConfig(routes={**general, **tasks})


class _BadRequest(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _describe(error: BaseException) -> str:
    # Bounded: an error message may quote the offending input, which may be huge.
    return f"{type(error).__name__}: {error}"[:500]


def _capped(record: Record, timeout_s: float) -> Record:
    if record.tests is not None and (record.tests.timeout_s is None or record.tests.timeout_s > timeout_s):
        # The client's deadline caps each sandboxed job of this request.
        return msgspec.structs.replace(
            record, tests=msgspec.structs.replace(record.tests, timeout_s=timeout_s)
        )
    return record


def request_to_item(req: rp.VerifyRequest, routes: Sequence[str]) -> VerifyItem:
    """(completion, record) for one request; raises `_BadRequest` naming the bad field."""
    if req.verifier not in routes:
        raise _BadRequest(
            "not_found", f"VerifyRequest.verifier={req.verifier!r}: not one of {sorted(routes)}"
        )
    if "record" in req.extra:
        try:
            record = msgspec.json.decode(req.extra["record"], type=Record)
        except (msgspec.DecodeError, RecursionError) as e:  # ValidationError is a DecodeError
            # msgspec recurses into nested JSON: deep nesting exhausts the stack.
            raise _BadRequest("malformed", f"VerifyRequest.extra['record']: {_describe(e)}") from None
        record = _capped(msgspec.structs.replace(record, task=req.verifier), req.timeout_s)
    else:
        metadata: dict[str, Any] = {}
        if "metadata" in req.extra:
            try:
                metadata = msgspec.json.decode(req.extra["metadata"], type=dict[str, Any])
            except (msgspec.DecodeError, RecursionError) as e:
                raise _BadRequest("malformed", f"VerifyRequest.extra['metadata']: {_describe(e)}") from None
        try:
            record = Record(
                id=req.request_id or "-",
                prompt="",
                answer=req.reference,
                task=req.verifier,
                metadata=metadata,
            )
        except ValueError as e:
            raise _BadRequest("malformed", f"VerifyRequest: {e}") from None
    return req.completion, record


class _WireItem(msgspec.Struct, array_like=True, frozen=True):
    """One item of a batch frame: ``[completion, record]``."""

    completion: str
    record: Record


class _BatchOutcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A batch reply frame: `results[i]` is item i's result, None when `refused` holds
    ``(i, code, why)`` for it."""

    results: list[VerifyResult | None]
    refused: list[tuple[int, str, str]] = []


_PAIRS_DECODER = msgspec.json.Decoder(list[tuple[str, Record]])
_RAW_DECODER = msgspec.json.Decoder(list[msgspec.Raw])
_ITEM_DECODER = msgspec.json.Decoder(_WireItem)
_OUTCOME_DECODER = msgspec.json.Decoder(_BatchOutcome)
_ENCODER = msgspec.json.Encoder()


def encode_batch(items: Sequence[VerifyItem]) -> bytes:
    """The JSON frame of a batch message (see the module docstring)."""
    # A (completion, record) pair encodes as the array `_WireItem` decodes.
    return _ENCODER.encode(items if isinstance(items, list) else list(items))


def decode_batch(
    data: bytes | memoryview, routes: Sequence[str] | dict[str, Any], timeout_s: float, *, max_items: int
) -> list[VerifyItem | _BadRequest]:
    """Each item of a batch frame, or why that item is refused (a bad item fails alone).

    Raises `_BadRequest` when the frame as a whole is unreadable or too long.
    """
    if len(data) > _COUNT_FIRST_BYTES:
        # Count before building records: a large frame of tiny items would otherwise
        # become millions of objects before its length could be refused.
        try:
            count = len(_RAW_DECODER.decode(data))
        except (msgspec.DecodeError, RecursionError) as e:
            raise _BadRequest("malformed", f"batch frame: {_describe(e)}") from None
        if count > max_items:
            raise _BadRequest("too_large", f"batch of {count} items: at most {max_items} per message")
    whole = True
    try:
        pairs: list[Any] = _PAIRS_DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError):
        whole = False
        # Some item is bad (or the frame is): read the array item by item to tell which.
        try:
            raws = _RAW_DECODER.decode(data)
        except (msgspec.DecodeError, RecursionError) as e:
            raise _BadRequest("malformed", f"batch frame: {_describe(e)}") from None
        pairs = []
        for n, raw in enumerate(raws):
            try:
                item = _ITEM_DECODER.decode(raw)
                pairs.append((item.completion, item.record))
            except (msgspec.DecodeError, RecursionError) as e:
                pairs.append(_BadRequest("malformed", f"batch item {n}: {_describe(e)}"))
    if len(pairs) > max_items:
        raise _BadRequest("too_large", f"batch of {len(pairs)} items: at most {max_items} per message")
    names = set(routes)
    if whole and {record.task for _, record in pairs} <= names and all(r.tests is None for _, r in pairs):
        return pairs  # the common case: every item served as it came
    out: list[VerifyItem | _BadRequest] = []
    for n, pair in enumerate(pairs):
        if isinstance(pair, _BadRequest):
            out.append(pair)
        elif pair[1].task not in names:
            out.append(
                _BadRequest("not_found", f"batch item {n}: task={pair[1].task!r}: not one of {sorted(names)}")
            )
        else:
            out.append((pair[0], _capped(pair[1], timeout_s)))
    return out


class _Plan:
    """Which items of the batch one message asked for, and how to answer it.

    Its items that were not refused on arrival lie in order from `start` in the
    batch's item list; `refused` maps a position in the message to why it was.
    """

    __slots__ = ("batch", "count", "header", "refused", "start")

    def __init__(self, header: rp.VerifyRequest | rp.VerifyBatch, batch: bool, start: int) -> None:
        self.header = header
        self.batch = batch
        self.start = start
        self.count = 0
        self.refused: dict[int, _BadRequest] = {}


class _Job:
    """One verification message's work: its items that were not refused on arrival, their
    results as they come, and the future its reply is sent from. `cheap` items are scored
    on the serving thread (`next` of them so far), then the `slow` ones (a sandboxed
    route's) in the code pool."""

    __slots__ = ("cheap", "client", "future", "items", "next", "plan", "results", "slow")

    def __init__(
        self, plan: _Plan, items: list[VerifyItem], client: bytes, slow_routes: Collection[str]
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
        self._main: rp.FairQueue[_Job] = rp.FairQueue()
        self._code = rp.FairPool(code_threads, name="rlax-verifier-code")
        self._env = rp.FairPool(env_threads, name="rlax-verifier-env")
        self._cost: dict[str, float] = {}  # seconds per item, by route (serving thread)
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
            except _BadRequest as e:
                self.stats["errors"] += 1
                self.stats["busy"] += e.code == "busy"
                out.append(rp.RemoteError(e.code, str(e)))
            except Exception as e:  # one message must never cost the others their answers
                self.stats["internal_errors"] += 1
                log.error("reading a request failed: %s", _describe(e), exc_info=e)
                out.append(rp.RemoteError("internal", _describe(e)))
        if verifying:
            self.stats["requests"] += verifying
            self.stats["batches"] += 1
        return out

    def _admit(self, message: rp.Message, frames: list[zmq.Frame], client: bytes) -> Future[BatchResult]:
        """Queue a message's work (within the client's share); the future of its reply."""
        with self._lock:
            mine, everyone = self._pending[client], sum(self._pending.values())
        if mine >= self.max_pending_per_client:
            raise _BadRequest(
                "busy",
                f"this client has {mine} requests waiting or running (the service's "
                f"max_pending_per_client={self.max_pending_per_client}); retry after {RETRY_AFTER_S:g}s",
            )
        if everyone >= self.max_pending:
            raise _BadRequest(
                "busy",
                f"the service has {everyone} requests waiting or running (max_pending="
                f"{self.max_pending}); retry after {RETRY_AFTER_S:g}s",
            )
        if isinstance(message, rp.EnvStepRequest):
            future = self._step(message, frames, client)
        else:
            items: list[VerifyItem] = []
            plan = self._plan(message, frames, items)
            self.stats["items"] += len(items)
            self._bound(items)
            job = _Job(plan, items, client, self._ceilings)
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
                items[n] = (completion, _capped(record, ceiling))

    def _step(
        self, request: rp.EnvStepRequest, frames: list[zmq.Frame], client: bytes
    ) -> Future[BatchResult]:
        if frames:
            raise _BadRequest("malformed", f"an EnvStepRequest takes no raw frames, got {len(frames)}")
        if len(request.turns) > self.max_env_turns:
            raise _BadRequest(
                "too_large",
                f"EnvStepRequest.turns: {len(request.turns)} turns, the service's max_env_turns is "
                f"{self.max_env_turns}",
            )
        asked = request.timeout_s
        if asked > self.max_timeout_s:
            request = msgspec.structs.replace(request, timeout_s=self.max_timeout_s)
        arrived = time.monotonic()

        def step() -> BatchResult:
            # The request's time runs from its arrival: waiting for a thread counts.
            reply = self.envs.answer(
                request, self.envs.submit(request), request.timeout_s - (time.monotonic() - arrived)
            )
            if asked > request.timeout_s and isinstance(reply, rp.RemoteError) and reply.code == "timeout":
                reply = rp.RemoteError(
                    "timeout",
                    f"{reply.remote_message} (the service's max_timeout_s={self.max_timeout_s:g}; "
                    f"the request asked {asked:g}s)",
                )
            return reply

        return self._env.submit(client, step)

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

    def _score_turn(self, queue: collections.deque[_Job]) -> None:
        """Score the next of one client's waiting items, as many as fit in half a slice."""
        budget = self.slice_s / 2
        taken: list[tuple[_Job, int]] = []
        cost = 0.0
        for job in queue:
            while job.next < len(job.cheap) and (cost < budget or not taken) and len(taken) < _MAX_TURN_ITEMS:
                i = job.cheap[job.next]
                job.next += 1
                taken.append((job, i))
                cost += self._cost.get(job.items[i][1].task or "", _FIRST_ITEM_COST_S)
            if job.next < len(job.cheap):
                break
        try:
            results = self._verify([job.items[i] for job, i in taken])
        except Exception as e:  # not one item's fault (`_verify` catches those): answer all
            self.stats["internal_errors"] += 1
            log.error("scoring a batch failed: %s", _describe(e), exc_info=e)
            results = [e] * len(taken)
        for (job, i), result in zip(taken, results, strict=True):
            job.results[i] = result
        while queue and queue[0].next == len(queue[0].cheap):
            job = queue.popleft()
            if job.slow:
                self._run_slow(job)
            else:
                self._answer(job)

    def _run_slow(self, job: _Job) -> None:
        """Score the job's sandboxed items in the code pool, then answer it from there."""

        def run() -> None:
            slow = self._verify([job.items[i] for i in job.slow])
            for i, result in zip(job.slow, slow, strict=True):
                job.results[i] = result
            self._answer(job)

        def check(ran: Future[None]) -> None:
            if ran.cancelled():
                job.future.cancel()
            elif (error := ran.exception()) is not None:
                _settle(job.future, rp.RemoteError("internal", _describe(error)))

        self._code.submit(job.client, run).add_done_callback(check)

    def _answer(self, job: _Job) -> None:
        try:
            reply = self._reply(job.plan, job.results)  # type: ignore[arg-type]  # all scored
        except Exception as e:
            self.stats["internal_errors"] += 1
            log.error("building a reply failed: %s", _describe(e), exc_info=e)
            reply = rp.RemoteError("internal", _describe(e))
        _settle(job.future, reply)

    def _plan(self, message: rp.Message, frames: list[zmq.Frame], items: list[VerifyItem]) -> _Plan:
        if isinstance(message, rp.VerifyRequest):
            if frames:
                raise _BadRequest("malformed", f"a VerifyRequest takes no raw frames, got {len(frames)}")
            plan = _Plan(message, batch=False, start=len(items))
            items.append(request_to_item(message, list(self.verifier.routes)))
            plan.count = 1
            return plan
        if not isinstance(message, rp.VerifyBatch):
            raise _BadRequest("unknown_message", f"{type(message).__name__} is not served here")
        if len(frames) != 1:
            raise _BadRequest("malformed", f"a batch takes one raw frame (its items), got {len(frames)}")
        decoded = decode_batch(
            frames[0].buffer, self.verifier.routes, message.timeout_s, max_items=self.max_items
        )
        if message.items != len(decoded):
            raise _BadRequest(
                "malformed", f"batch header says {message.items} items, frame holds {len(decoded)}"
            )
        plan = _Plan(message, batch=True, start=len(items))
        plan.count = len(decoded)
        for n, item in enumerate(decoded):
            if isinstance(item, _BadRequest):
                plan.refused[n] = item
            else:
                items.append(item)
        return plan

    def _reply(self, plan: _Plan, results: list[VerifyResult | Exception]) -> BatchResult:
        header = plan.header
        if not plan.batch:
            res = results[plan.start]
            if isinstance(res, Exception):
                self.stats["errors"] += 1
                return rp.RemoteError("bad_request", _describe(res))
            return rp.VerifyResult(
                request_id=header.request_id,
                reward=res.reward,
                correct=res.correct,
                detail=msgspec.json.encode(res.details).decode(),
            )
        mine = results[plan.start : plan.start + plan.count - len(plan.refused)]
        scored: list[VerifyResult | Exception | None]
        if plan.refused:  # put the refused back in their places
            scored, it = [], iter(mine)
            for n in range(plan.count):
                scored.append(None if n in plan.refused else next(it))
        else:
            scored = list(mine)
        refused = [(n, e.code, str(e)) for n, e in plan.refused.items()]
        for n, res in enumerate(scored):
            if isinstance(res, Exception):
                refused.append((n, "bad_request", _describe(res)))
                scored[n] = None
        outcome = _BatchOutcome(scored, sorted(refused))  # type: ignore[arg-type]  # no exceptions left
        try:
            frame = _ENCODER.encode(outcome)
        except (TypeError, ValueError, OverflowError, RecursionError):
            # Some verifier returned details that cannot be sent: that item fails alone.
            for n, res in enumerate(scored):
                if isinstance(res, VerifyResult) and (why := _unencodable(res)):
                    scored[n] = None
                    refused.append((n, "internal", f"result cannot be sent: {why}"))
            frame = _ENCODER.encode(_BatchOutcome(scored, sorted(refused)))  # type: ignore[arg-type]
        self.stats["errors"] += len(refused)
        reply = rp.VerifyBatchResult(request_id=header.request_id, items=plan.count, refused=len(refused))
        return reply, [frame]

    def _verify(self, items: list[VerifyItem]) -> list[VerifyResult | Exception]:
        """One result or the exception that refused it, per item, route by route (each
        route's cost per item noted, for the next turn's size)."""
        out: list[VerifyResult | Exception | None] = [None] * len(items)
        tasks = {record.task or "" for _, record in items}  # served routes, checked on arrival
        if len(tasks) == 1:  # the common case: no grouping to do
            (route,) = tasks
            by_route: dict[str, Sequence[int]] = {route: range(len(items))}
        else:
            by_route = {}
            for i, (_, record) in enumerate(items):
                by_route.setdefault(record.task or "", []).append(i)  # type: ignore[attr-defined]
        for route, indices in by_route.items():
            started = time.perf_counter()
            self._verify_route(self.verifier.routes[route], items, indices, out)
            per_item = (time.perf_counter() - started) / max(1, len(indices))
            self._cost[route] = 0.5 * (self._cost.get(route, per_item) + per_item)
        return out  # type: ignore[return-value]

    def _verify_route(
        self,
        verifier: Verifier,
        items: list[VerifyItem],
        indices: Sequence[int],
        out: list[VerifyResult | Exception | None],
    ) -> None:
        try:
            whole = isinstance(indices, range) and len(indices) == len(items)
            results = verifier.verify(items if whole else [items[i] for i in indices])
            if len(results) != len(indices):
                raise RuntimeError(f"verifier returned {len(results)} results for {len(indices)} items")
        except Exception as e:
            if len(indices) == 1:
                log.warning("verification failed: %s", _describe(e))
                out[indices[0]] = e
                return
            # Halve until the refused records stand alone; the others keep being scored
            # together (in parallel, for code) in the largest batches that succeed.
            mid = len(indices) // 2
            self._verify_route(verifier, items, indices[:mid], out)
            self._verify_route(verifier, items, indices[mid:], out)
            return
        for i, res in zip(indices, results):
            out[i] = res


def _settle(future: Future[BatchResult], reply: BatchResult) -> None:
    try:
        future.set_result(reply)
    except InvalidStateError:  # cancelled: the service is closing
        pass


def _unencodable(result: VerifyResult) -> str:
    """Why `result` cannot be encoded, or "" when it can."""
    try:
        _ENCODER.encode(result)
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        return _describe(e)
    return ""


class RemoteVerifier:
    """A `Verifier` whose work is done by an `rlax-verifier` service.

    The items go in batch messages of at most `chunk_items` items (and about
    `chunk_bytes` bytes), pipelined; `timeout_s` bounds the wait for the whole call. A
    message the service answers ``busy`` (too many of ours waiting) is sent again after
    the wait it suggests, within that bound. Raises `RemoteError` if the service refuses
    an item (naming the first refused).
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float = 60.0,
        client: rp.RpcClient | None = None,
        chunk_items: int = 1024,
        chunk_bytes: int = MAX_BATCH_BYTES // 4,
        sandbox_timeout_s: float = 10.0,
    ):
        if chunk_items < 1 or chunk_bytes < 1:
            raise ValueError(f"chunk_items={chunk_items} and chunk_bytes={chunk_bytes}: must be >= 1")
        self.client = client or rp.RpcClient(address, timeout_s=timeout_s, role="verifier-client")
        self.timeout_s = timeout_s
        self.chunk_items = chunk_items
        self.chunk_bytes = chunk_bytes
        self.sandbox_timeout_s = sandbox_timeout_s

    def _chunks(self, items: Sequence[VerifyItem], start: int) -> list[tuple[int, int, bytes]]:
        """(first index, count, frame) per batch message, halving any over `chunk_bytes`."""
        frame = encode_batch(items)
        if len(frame) <= self.chunk_bytes or len(items) == 1:
            return [(start, len(items), frame)]
        mid = len(items) // 2
        return self._chunks(items[:mid], start) + self._chunks(items[mid:], start + mid)

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        deadline = rp.Deadline(self.timeout_s)
        for attempt in range(2):
            try:
                return self._verify_once(items, deadline)
            except rp.RemoteError as e:
                if e.code != "handshake_required" or attempt:
                    raise
                self.client.reset()  # the service restarted or forgot us: say Hello again
        raise AssertionError("unreachable")

    def _verify_once(self, items: Sequence[VerifyItem], deadline: rp.Deadline) -> list[VerifyResult]:
        sent: dict[int, tuple[int, int, bytes]] = {}

        def send(start: int, count: int, frame: bytes) -> None:
            header = rp.VerifyBatch(
                request_id=f"batch-{start}", items=count, timeout_s=self.sandbox_timeout_s
            )
            rid = self.client.send_request(header, [frame], timeout_s=max(deadline.remaining(), 1e-3))
            sent[rid] = (start, count, frame)
            pending.add(rid)

        pending: set[int] = set()
        for s in range(0, len(items), self.chunk_items):
            for start, count, frame in self._chunks(items[s : s + self.chunk_items], s):
                send(start, count, frame)
        out: list[VerifyResult | None] = [None] * len(items)
        while pending:
            rid, reply = self.client.recv_reply(
                pending, timeout_s=deadline.remaining(), operation="VerifyRequest batch"
            )
            pending.discard(rid)
            start, count, frame = sent.pop(rid)
            msg = reply.message
            if isinstance(msg, rp.ErrorReply) and msg.code == "busy" and deadline.remaining() > RETRY_AFTER_S:
                time.sleep(RETRY_AFTER_S)  # replies meanwhile wait in the socket
                send(start, count, frame)
                continue
            if isinstance(msg, rp.ErrorReply):
                raise rp.RemoteError(msg.code, msg.message, peer=self.client.peer)
            if not isinstance(msg, rp.VerifyBatchResult) or len(reply.frames) != 1:
                raise rp.MalformedMessageError(
                    f"verifier answered a batch with {type(msg).__name__} and {len(reply.frames)} frames"
                )
            try:
                outcome = _OUTCOME_DECODER.decode(reply.frames[0].buffer)
            except (msgspec.DecodeError, RecursionError) as e:
                raise rp.MalformedMessageError(f"verifier's batch reply: {_describe(e)}") from None
            if len(outcome.results) != count:
                raise rp.MalformedMessageError(
                    f"verifier answered {len(outcome.results)} of a batch of {count}"
                )
            if outcome.refused:
                n, code, why = outcome.refused[0]
                raise rp.RemoteError(code, f"item {start + n}: {why}", peer=self.client.peer)
            if any(r is None for r in outcome.results):
                raise rp.MalformedMessageError("verifier left an item of a batch without a result")
            out[start : start + count] = outcome.results
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.client.close()


def _load_config(path: str | None) -> RoutingConfig:
    if path is None:
        return default_routes()
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping (a verifier config), got {type(data).__name__}")
    cfg = load_verifier_config(data)
    if not isinstance(cfg, RoutingConfig):
        raise ValueError(f"{path}: field `kind` must be 'routing' for the service, got {data.get('kind')!r}")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlax-verifier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", default=DEFAULT_ADDRESS, help="ZeroMQ address to bind (default: loopback)")
    parser.add_argument("--config", help="YAML routing config ({kind: routing, routes: {...}})")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--poll-s", type=float, default=0.2)
    parser.add_argument(
        "--batch-window-s",
        type=float,
        default=0.0,
        help="after a request arrives, wait this long for more to score with it (default: none)",
    )
    parser.add_argument(
        "--code-threads",
        type=int,
        default=2,
        help="sandboxed batches run at once (each runs its route's sandbox.workers programs at once)",
    )
    parser.add_argument(
        "--max-timeout-s",
        type=float,
        default=60.0,
        help="the longest an environment step may run, whatever its request asks (default 60)",
    )
    parser.add_argument(
        "--max-pending-per-client",
        type=int,
        default=64,
        help="messages one client may have waiting or running; more are answered busy (default 64)",
    )
    parser.add_argument(
        "--environment",
        action="append",
        default=[],
        metavar="PACKAGE.MODULE:FACTORY",
        help="also serve this environment for multi-turn rollouts (registered ones always are)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlax-verifier %(levelname)s %(message)s")
    cfg = _load_config(args.config)
    verifier = build_verifier(cfg)
    assert isinstance(verifier, RoutingVerifier)
    service = VerifierService(
        verifier,
        address=args.bind,
        max_batch=args.max_batch,
        batch_window_s=args.batch_window_s,
        poll_s=args.poll_s,
        env_paths=args.environment,
        code_threads=args.code_threads,
        max_timeout_s=args.max_timeout_s,
        max_pending_per_client=args.max_pending_per_client,
    )
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    # Each batch decodes thousands of records that survive into the oldest GC generation
    # until it is answered, so full collections come every few batches; freezing what
    # start-up built keeps them from rescanning it (about 40% of an exact-match batch).
    gc.freeze()
    # The bound address (a random port when asked for :0) is the first line on stdout.
    print(service.bound_address, flush=True)
    log.info("serving routes %s", sorted(verifier.routes))
    try:
        service.serve()
    finally:
        service.close()
    log.info("stopped after %s", {**service.stats, **service.envs.stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
