"""The wire format of the verifier service (`rlax-verifier`), shared by the service and
its client `RemoteVerifier`.

Framing: the `rlax_protocol` request/reply framing (DEALER client -> ROUTER server). A
client says `Hello`, then sends either

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

How a single `VerifyRequest` maps onto a record: `verifier` picks the route (it
becomes the record's `task`); `extra["record"]`, when present, is a JSON-encoded
`Record` (tests for code, numbers and target for Countdown); otherwise the record is
built from `reference` (the answer) and `extra["metadata"]` (a JSON object), if given.
A request's (or a batch's) `timeout_s` caps each sandboxed job of its records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

import rlax_protocol as rp
from rlax_data.datasets import Record
from rlax_data.verify.base import VerifyItem, VerifyResult

DEFAULT_ADDRESS = "tcp://127.0.0.1:5599"
"""Where the service binds, and its clients connect, unless told otherwise."""
MAX_BATCH_ITEMS = 65_536
"""Most items one batch message may hold."""
MAX_BATCH_BYTES = 32 * 1024 * 1024
"""Most bytes one request (header and frames) may hold."""
_COUNT_FIRST_BYTES = 1 << 20
RETRY_AFTER_S = 1.0
"""The wait a ``busy`` answer suggests before the request is sent again."""


class BadRequest(ValueError):
    """A request (or one item of a batch) the service refuses; `code` is the error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def describe(error: BaseException) -> str:
    """`error` as a short text for a reply or a log line."""
    # Bounded: an error message may quote the offending input, which may be huge.
    return f"{type(error).__name__}: {error}"[:500]


def capped(record: Record, timeout_s: float) -> Record:
    """`record` with its sandboxed job limited to `timeout_s`."""
    if record.tests is not None and (record.tests.timeout_s is None or record.tests.timeout_s > timeout_s):
        # The client's deadline caps each sandboxed job of this request.
        return msgspec.structs.replace(
            record, tests=msgspec.structs.replace(record.tests, timeout_s=timeout_s)
        )
    return record


def request_to_item(req: rp.VerifyRequest, routes: Sequence[str]) -> VerifyItem:
    """(completion, record) for one request; raises `BadRequest` naming the bad field."""
    if req.verifier not in routes:
        raise BadRequest("not_found", f"VerifyRequest.verifier={req.verifier!r}: not one of {sorted(routes)}")
    if "record" in req.extra:
        try:
            record = msgspec.json.decode(req.extra["record"], type=Record)
        except (msgspec.DecodeError, RecursionError) as e:  # ValidationError is a DecodeError
            # msgspec recurses into nested JSON: deep nesting exhausts the stack.
            raise BadRequest("malformed", f"VerifyRequest.extra['record']: {describe(e)}") from None
        record = capped(msgspec.structs.replace(record, task=req.verifier), req.timeout_s)
    else:
        metadata: dict[str, Any] = {}
        if "metadata" in req.extra:
            try:
                metadata = msgspec.json.decode(req.extra["metadata"], type=dict[str, Any])
            except (msgspec.DecodeError, RecursionError) as e:
                raise BadRequest("malformed", f"VerifyRequest.extra['metadata']: {describe(e)}") from None
        try:
            record = Record(
                id=req.request_id or "-",
                prompt="",
                answer=req.reference,
                task=req.verifier,
                metadata=metadata,
            )
        except ValueError as e:
            raise BadRequest("malformed", f"VerifyRequest: {e}") from None
    return req.completion, record


class _WireItem(msgspec.Struct, array_like=True, frozen=True):
    """One item of a batch frame: ``[completion, record]``."""

    completion: str
    record: Record


class BatchOutcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A batch reply frame: `results[i]` is item i's result, None when `refused` holds
    ``(i, code, why)`` for it."""

    results: list[VerifyResult | None]
    refused: list[tuple[int, str, str]] = []


_PAIRS_DECODER = msgspec.json.Decoder(list[tuple[str, Record]])
_RAW_DECODER = msgspec.json.Decoder(list[msgspec.Raw])
_ITEM_DECODER = msgspec.json.Decoder(_WireItem)
_OUTCOME_DECODER = msgspec.json.Decoder(BatchOutcome)
_ENCODER = msgspec.json.Encoder()


def encode_outcome(outcome: BatchOutcome) -> bytes:
    """The JSON frame of a batch reply."""
    return _ENCODER.encode(outcome)


def decode_outcome(data: bytes | memoryview) -> BatchOutcome:
    """A batch reply frame; raises `msgspec.DecodeError` (or `RecursionError`) when unreadable."""
    return _OUTCOME_DECODER.decode(data)


def encode_batch(items: Sequence[VerifyItem]) -> bytes:
    """The JSON frame of a batch message (see the module docstring)."""
    # A (completion, record) pair encodes as the array `_WireItem` decodes.
    return _ENCODER.encode(items if isinstance(items, list) else list(items))


def decode_batch(
    data: bytes | memoryview, routes: Sequence[str] | dict[str, Any], timeout_s: float, *, max_items: int
) -> list[VerifyItem | BadRequest]:
    """Each item of a batch frame, or why that item is refused (a bad item fails alone).

    Raises `BadRequest` when the frame as a whole is unreadable or too long.
    """
    if len(data) > _COUNT_FIRST_BYTES:
        # Count before building records: a large frame of tiny items would otherwise
        # become millions of objects before its length could be refused.
        try:
            count = len(_RAW_DECODER.decode(data))
        except (msgspec.DecodeError, RecursionError) as e:
            raise BadRequest("malformed", f"batch frame: {describe(e)}") from None
        if count > max_items:
            raise BadRequest("too_large", f"batch of {count} items: at most {max_items} per message")
    whole = True
    try:
        pairs: list[Any] = _PAIRS_DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError):
        whole = False
        # Some item is bad (or the frame is): read the array item by item to tell which.
        try:
            raws = _RAW_DECODER.decode(data)
        except (msgspec.DecodeError, RecursionError) as e:
            raise BadRequest("malformed", f"batch frame: {describe(e)}") from None
        pairs = []
        for n, raw in enumerate(raws):
            try:
                item = _ITEM_DECODER.decode(raw)
                pairs.append((item.completion, item.record))
            except (msgspec.DecodeError, RecursionError) as e:
                pairs.append(BadRequest("malformed", f"batch item {n}: {describe(e)}"))
    if len(pairs) > max_items:
        raise BadRequest("too_large", f"batch of {len(pairs)} items: at most {max_items} per message")
    names = set(routes)
    if whole and {record.task for _, record in pairs} <= names and all(r.tests is None for _, r in pairs):
        return pairs  # the common case: every item served as it came
    out: list[VerifyItem | BadRequest] = []
    for n, pair in enumerate(pairs):
        if isinstance(pair, BadRequest):
            out.append(pair)
        elif pair[1].task not in names:
            out.append(
                BadRequest("not_found", f"batch item {n}: task={pair[1].task!r}: not one of {sorted(names)}")
            )
        else:
            out.append((pair[0], capped(pair[1], timeout_s)))
    return out


def unencodable(result: VerifyResult) -> str:
    """Why `result` cannot be encoded, or "" when it can."""
    try:
        _ENCODER.encode(result)
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        return describe(e)
    return ""
