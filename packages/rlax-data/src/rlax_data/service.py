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
`max_batch`) and scores all their items as one batch per verifier route, so the
code sandbox runs the batch's programs in parallel. An item whose record is
malformed, names no served route, or is refused by its verifier fails alone (see
`VerifierService`); a message that cannot be read at all gets an `ErrorReply`. No
message, however hostile, stops the server, and every receive has a timeout.

How a single `VerifyRequest` maps onto a record: `verifier` picks the route (it
becomes the record's `task`); `extra["record"]`, when present, is a JSON-encoded
`Record` (tests for code, numbers and target for Countdown); otherwise the record is
built from `reference` (the answer) and `extra["metadata"]` (a JSON object), if given.
A request's (or a batch's) `timeout_s` caps each sandboxed job of its records.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import time
from collections.abc import Sequence
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
from rlax_data.verify.registry import RoutingConfig, RoutingVerifier, build_verifier, load_verifier_config
from rlax_protocol.rpc_server import BatchResult

__all__ = ["RemoteVerifier", "VerifierService", "default_routes", "main"]

log = logging.getLogger("rlax_data.service")

DEFAULT_ADDRESS = "tcp://127.0.0.1:5599"
"""The `VerifyRequest.verifier` of a batch header (never a route name: routes may not start with @)."""
MAX_BATCH_ITEMS = 65_536
"""Most items one batch message may hold."""
MAX_BATCH_BYTES = 32 * 1024 * 1024
"""Most bytes one request (header and frames) may hold."""
_COUNT_FIRST_BYTES = 1 << 20


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


class VerifierService:
    """`rlax_protocol.RpcServer` with a batch handler that scores `VerifyRequest`s.

    It binds when built (`bound_address` is then known); `serve()` answers requests
    in the calling thread until `stop()` (or SIGTERM/SIGINT via `main`); `close()`
    releases the socket.

    The items of every message drained together are scored one verifier route at a
    time, so a record one route refuses cannot make another route's programs run
    again. Within a route, a batch that raises is split in halves until each refused
    record stands alone: the refused record gets an error, and the rest are scored in
    the largest batches that succeed. Verifiers check every record of a batch before
    they run anything (the code verifier builds all its jobs before it starts the
    sandbox), so a refused batch has run no program and no program runs twice.
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
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        self.verifier = verifier
        # Multi-turn environments run here for the workers (`agent.where: service`).
        self.envs = EnvStepServer(threads=env_threads, allowed_paths=env_paths)
        self.max_items = max_items
        self.poll_s = poll_s
        self.stats = {"requests": 0, "items": 0, "batches": 0, "errors": 0, "internal_errors": 0}
        self.server = rp.RpcServer(
            address,
            batch_handler=self._handle,
            max_batch=max_batch,
            batch_window_s=batch_window_s,
            max_request_bytes=max_request_bytes,
            poll_s=poll_s,
            server_id=server_id,
        )
        self.bound_address: str = self.server.listen()

    def stop(self) -> None:
        """Make `serve()` return (within `poll_s`); safe from a signal handler."""
        self.server.shutdown()

    def close(self) -> None:
        self.server.stop()
        self.envs.close()

    def serve(self) -> None:
        """Serve in the calling thread until `stop()`; verifiers that use signals (math
        with a timeout) need this to be the main thread."""
        self.server.serve_forever()

    # -- the batch handler

    def _handle(self, batch: list[tuple[rp.Message, list[zmq.Frame]]]) -> list[BatchResult]:
        """One reply (or error) per message, in order: environment steps run in the
        environment pool while the verification items are scored here."""
        started = time.monotonic()
        steps: dict[int, Any] = {}
        for i, (message, frames) in enumerate(batch):
            if isinstance(message, rp.EnvStepRequest):
                steps[i] = (
                    rp.RemoteError("malformed", f"an EnvStepRequest takes no raw frames, got {len(frames)}")
                    if frames
                    else (message, self.envs.submit(message))
                )
        if not steps:
            return self._handle_verify(batch)
        rest = [pair for i, pair in enumerate(batch) if i not in steps]
        verified = iter(self._handle_verify(rest) if rest else [])
        out: list[BatchResult] = []
        for i in range(len(batch)):
            if i not in steps:
                out.append(next(verified))
            elif isinstance(steps[i], Exception):
                out.append(steps[i])
            else:
                request, future = steps[i]
                wait_s = request.timeout_s - (time.monotonic() - started)
                out.append(self.envs.answer(request, future, wait_s))
        return out

    def _handle_verify(self, batch: list[tuple[rp.Message, list[zmq.Frame]]]) -> list[BatchResult]:
        """One reply (or error) per message; all their items scored together."""
        self.stats["requests"] += len(batch)
        self.stats["batches"] += 1
        items: list[VerifyItem] = []
        plans: list[_Plan | Exception] = []
        for message, frames in batch:
            try:
                plans.append(self._plan(message, frames, items))
            except _BadRequest as e:
                plans.append(rp.RemoteError(e.code, str(e)))
            except Exception as e:  # one message must never cost the others their answers
                self.stats["internal_errors"] += 1
                log.error("reading a request failed: %s", _describe(e), exc_info=e)
                plans.append(rp.RemoteError("internal", _describe(e)))
        self.stats["items"] += len(items)
        results: list[VerifyResult | Exception]
        try:
            results = self._verify(items)
        except Exception as e:  # not one item's fault (`_verify` catches those): answer all
            self.stats["internal_errors"] += 1
            log.error("scoring a batch failed: %s", _describe(e), exc_info=e)
            results = [e] * len(items)
        out: list[BatchResult] = []
        for plan in plans:
            if isinstance(plan, Exception):
                self.stats["errors"] += 1
                out.append(plan)
                continue
            try:
                out.append(self._reply(plan, results))
            except Exception as e:
                self.stats["internal_errors"] += 1
                log.error("building a reply failed: %s", _describe(e), exc_info=e)
                out.append(rp.RemoteError("internal", _describe(e)))
        return out

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
        """One result or the exception that refused it, per item, route by route."""
        out: list[VerifyResult | Exception | None] = [None] * len(items)
        tasks = {record.task or "" for _, record in items}  # served routes, checked on arrival
        if len(tasks) == 1:  # the common case: no grouping to do
            (route,) = tasks
            self._verify_route(self.verifier.routes[route], items, range(len(items)), out)
            return out  # type: ignore[return-value]
        by_route: dict[str, list[int]] = {}
        for i, (_, record) in enumerate(items):
            by_route.setdefault(record.task or "", []).append(i)
        for route, indices in by_route.items():
            self._verify_route(self.verifier.routes[route], items, indices, out)
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
    `chunk_bytes` bytes), pipelined; `timeout_s` bounds the wait for the whole call.
    Raises `RemoteError` if the service refuses an item (naming the first refused).
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
        sent: dict[int, tuple[int, int]] = {}
        for s in range(0, len(items), self.chunk_items):
            for start, count, frame in self._chunks(items[s : s + self.chunk_items], s):
                header = rp.VerifyBatch(
                    request_id=f"batch-{start}", items=count, timeout_s=self.sandbox_timeout_s
                )
                rid = self.client.send_request(header, [frame], timeout_s=max(deadline.remaining(), 1e-3))
                sent[rid] = (start, count)
        out: list[VerifyResult | None] = [None] * len(items)
        pending = set(sent)
        while pending:
            rid, reply = self.client.recv_reply(
                pending, timeout_s=deadline.remaining(), operation="VerifyRequest batch"
            )
            pending.discard(rid)
            start, count = sent[rid]
            msg = reply.message
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
