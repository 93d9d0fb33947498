"""How `RpcServer` turns requests into replies: it calls the service's handler (one
request at a time, or a batch), and makes whatever comes back (a reply, an exception,
a future of either) into a message and its frames.

Kept apart from the server's socket loop: this part never touches a socket, so what a
handler may return and how each outcome is answered reads in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from rlax_protocol.errors import ProtocolError, RemoteError
from rlax_protocol.messages import ErrorReply, Message
from rlax_protocol.transport import Request

log = logging.getLogger(__name__)

Frames = Sequence[bytes | memoryview | zmq.Frame]
HandlerResult = Message | tuple[Message, Frames]
BatchResult = HandlerResult | Exception | Future[Any]
"""A reply, an exception for that request alone, or a future of either (answered when done)."""
Handler = Callable[[Message, list[zmq.Frame]], HandlerResult | Future[Any]]
BatchHandler = Callable[[list[tuple[Message, list[zmq.Frame]]]], Sequence[BatchResult]]
PeerBatchHandler = Callable[[list[tuple[Message, list[zmq.Frame], bytes]]], Sequence[BatchResult]]
Reply = tuple[Message, Frames] | Future[Any]

_ERROR_TEXT_LIMIT = 1000  # an error text may quote hostile input: keep replies small


class RequestDispatcher:
    """Hands screened requests to exactly one of `handler` and `batch_handler` (with
    `with_peer`, the batch handler also gets each client's routing identity) and gives
    one reply, or a future of it, per request."""

    def __init__(
        self,
        handler: Handler | None,
        batch_handler: BatchHandler | PeerBatchHandler | None,
        *,
        server_id: str,
        with_peer: bool,
    ) -> None:
        if (handler is None) == (batch_handler is None):
            raise ValueError("RpcServer: give exactly one of handler and batch_handler")
        self.handler = handler
        self.batch_handler = batch_handler
        self.server_id = server_id
        self.with_peer = with_peer

    def handle(self, requests: list[Request]) -> list[Reply]:
        """One reply (or a future of it) per request (all screened), through whichever
        handler was given."""
        if self.handler is not None:
            return [self._call_one(self.handler, r) for r in requests]
        assert self.batch_handler is not None
        work: list[Any] = [
            (r.message, r.frames, r.identity) if self.with_peer else (r.message, r.frames)
            for r in requests
            if r.message is not None
        ]
        try:
            results = self.batch_handler(work)
            if len(results) != len(work):
                raise RuntimeError(f"batch handler returned {len(results)} results for {len(work)} requests")
            return [r if isinstance(r, Future) else reply_for(r, self.server_id) for r in results]
        except Exception as err:
            if len(requests) == 1:
                return [reply_for(err, self.server_id)]
            # Not one request's fault that we can see: each is tried alone, so a request
            # that makes the batch handler raise fails by itself.
            log.warning("%s: batch of %d failed (%s); answering each alone", self.server_id, len(work), err)
            return [self.handle([r])[0] for r in requests]

    @staticmethod
    def _call_one(handler: Handler, request: Request) -> Reply:
        assert request.message is not None
        try:
            result: BatchResult = handler(request.message, request.frames)
        except Exception as err:
            result = err
        return result if isinstance(result, Future) else reply_for(result, "handler")


def bounded_text(text: str) -> str:
    """`text` cut to the length an error reply may carry."""
    return text if len(text) <= _ERROR_TEXT_LIMIT else text[:_ERROR_TEXT_LIMIT] + "..."


def internal_error(text: str) -> ErrorReply:
    return ErrorReply(code="internal", message=bounded_text(text))


def reply_for(result: BatchResult, who: str) -> tuple[Message, Frames]:
    """A handler's result (or the exception it raised or returned) as a reply and frames."""
    if isinstance(result, RemoteError):
        return ErrorReply(code=result.code, message=bounded_text(result.remote_message)), ()
    if isinstance(result, ProtocolError):
        return ErrorReply(code="malformed", message=bounded_text(str(result))), ()
    if isinstance(result, Exception):  # one bad request must not stop the service
        log.error("%s failed: %s: %s", who, type(result).__name__, result, exc_info=result)
        return internal_error(f"{type(result).__name__}: {result}"), ()
    if isinstance(result, tuple):
        return result
    if isinstance(result, Message):
        return result, ()
    return internal_error(f"{who} returned {type(result).__name__}, not a message"), ()


def outcome_of(future: Future[Any], who: str) -> tuple[Message, Frames]:
    """The reply a done future holds (what it raised, or its cancellation, as an error)."""
    if future.cancelled():
        return internal_error("the server stopped before answering"), ()
    error = future.exception()
    if error is not None and not isinstance(error, Exception):  # SystemExit and the like
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return reply_for(error if error is not None else future.result(), who)
