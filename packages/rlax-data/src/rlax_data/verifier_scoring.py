"""How the verifier service scores: the items a message asks for (`plan_message`), its
reply once they are scored (`build_reply`), and the scoring itself, route by route, a
refused record failing alone (`RouteScorer`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import msgspec
import zmq

import rlax_protocol as rp
from rlax_data.verifier_wire import (
    BadRequest,
    BatchOutcome,
    decode_batch,
    describe,
    encode_outcome,
    request_to_item,
    unencodable,
)
from rlax_data.verify.base import Verifier, VerifyItem, VerifyResult
from rlax_protocol.rpc_server import BatchResult

log = logging.getLogger(__name__)


class Plan:
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
        self.refused: dict[int, BadRequest] = {}


def plan_message(
    message: rp.Message,
    frames: list[zmq.Frame],
    items: list[VerifyItem],
    routes: dict[str, Verifier],
    max_items: int,
) -> Plan:
    """Append the items `message` asks to score to `items` (refusing a bad one alone);
    how to answer it. Raises `BadRequest` when the message as a whole is refused."""
    if isinstance(message, rp.VerifyRequest):
        if frames:
            raise BadRequest("malformed", f"a VerifyRequest takes no raw frames, got {len(frames)}")
        plan = Plan(message, batch=False, start=len(items))
        items.append(request_to_item(message, list(routes)))
        plan.count = 1
        return plan
    if not isinstance(message, rp.VerifyBatch):
        raise BadRequest("unknown_message", f"{type(message).__name__} is not served here")
    if len(frames) != 1:
        raise BadRequest("malformed", f"a batch takes one raw frame (its items), got {len(frames)}")
    decoded = decode_batch(frames[0].buffer, routes, message.timeout_s, max_items=max_items)
    if message.items != len(decoded):
        raise BadRequest("malformed", f"batch header says {message.items} items, frame holds {len(decoded)}")
    plan = Plan(message, batch=True, start=len(items))
    plan.count = len(decoded)
    for n, item in enumerate(decoded):
        if isinstance(item, BadRequest):
            plan.refused[n] = item
        else:
            items.append(item)
    return plan


def build_reply(plan: Plan, results: list[VerifyResult | Exception], stats: dict[str, int]) -> BatchResult:
    """The reply to the message `plan` describes, from the results of the batch its items
    lie in; counts the items it refuses in `stats["errors"]`."""
    header = plan.header
    if not plan.batch:
        res = results[plan.start]
        if isinstance(res, Exception):
            stats["errors"] += 1
            return rp.RemoteError("bad_request", describe(res))
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
    for n, outcome_of_item in enumerate(scored):
        if isinstance(outcome_of_item, Exception):
            refused.append((n, "bad_request", describe(outcome_of_item)))
            scored[n] = None
    outcome = BatchOutcome(scored, sorted(refused))  # type: ignore[arg-type]  # no exceptions left
    try:
        frame = encode_outcome(outcome)
    except (TypeError, ValueError, OverflowError, RecursionError):
        # Some verifier returned details that cannot be sent: that item fails alone.
        for n, outcome_of_item in enumerate(scored):
            if isinstance(outcome_of_item, VerifyResult) and (why := unencodable(outcome_of_item)):
                scored[n] = None
                refused.append((n, "internal", f"result cannot be sent: {why}"))
        frame = encode_outcome(BatchOutcome(scored, sorted(refused)))  # type: ignore[arg-type]
    stats["errors"] += len(refused)
    reply = rp.VerifyBatchResult(request_id=header.request_id, items=plan.count, refused=len(refused))
    return reply, [frame]


class RouteScorer:
    """Scores items with the verifier of each one's route, and notes what an item of each
    route costs (seconds, a running average), so the service can size its turns."""

    def __init__(self, routes: dict[str, Verifier]) -> None:
        self.routes = routes
        self.cost: dict[str, float] = {}

    def verify(self, items: list[VerifyItem]) -> list[VerifyResult | Exception]:
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
            self._verify_route(self.routes[route], items, indices, out)
            per_item = (time.perf_counter() - started) / max(1, len(indices))
            self.cost[route] = 0.5 * (self.cost.get(route, per_item) + per_item)
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
                log.warning("verification failed: %s", describe(e))
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
