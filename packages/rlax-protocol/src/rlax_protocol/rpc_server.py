"""A small request/reply server for RLAX services (verifier service, workers' control ports).

`RpcServer` binds a ROUTER socket, runs the handshake (`Hello` -> `Welcome`, refusing
other protocol versions), and hands every other request to the service, from a thread
of its own (`start()`) or the caller's (`serve_forever()`, for handlers that must run
on the main thread), either one at a time (``handler(message, frames)``) or in batches
(``batch_handler([(message, frames), ...])``): each time it wakes it drains the
requests already waiting (at most `max_batch`, optionally waiting `batch_window_s`
for more) and passes the well-formed ones to the batch handler in one call, then
answers each request on its own. A batch handler returns one result per request, a
reply or an exception for that request alone; if it raises instead (or returns the
wrong number of results) each request of the batch is handed to it again alone, so
one bad request cannot take the others' answers with it.

Anything malformed, unexpected or larger than `max_request_bytes` is answered with an
`ErrorReply` and the server keeps serving; a handler exception becomes an
``internal`` error reply. For high-throughput byte movement see how `rlax_paramserver`
adds worker threads.

Slow work never has to run on the thread that receives messages: a handler may answer a
request later by returning a `concurrent.futures.Future` of its reply (work handed to a
`FairPool`, say). The loop sends the reply once the future is done, from its own thread
(ZeroMQ sockets are not thread-safe): a done future is queued and wakes the loop through a
pipe it polls beside the socket. Work that must stay on the serving thread (math
verification uses signals) can be done in bounded slices between receives: `main_work()`
is called after every wake and says whether more remains (the loop then polls without
sleeping), so requests keep being received, and answered, while it is done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from rlax_protocol.auth import Credential, Permissions, ServerAuth
from rlax_protocol.messages import ErrorReply, Message
from rlax_protocol.rpc_deferred import DeferredReplies
from rlax_protocol.rpc_replies import (
    BatchHandler,
    BatchResult,
    Frames,
    Handler,
    HandlerResult,
    PeerBatchHandler,
    Reply,
    RequestDispatcher,
    bounded_text,
    internal_error,
    outcome_of,
)
from rlax_protocol.transport import (
    CurveServerConfig,
    Deadline,
    PeerRegistry,
    Request,
    parse_request,
    reply_parts,
    start_curve_server,
    unpack_request_id,
)

__all__ = [
    "BatchHandler",
    "BatchResult",
    "Frames",
    "Handler",
    "HandlerResult",
    "PeerBatchHandler",
    "Reply",
    "RpcServer",
]

log = logging.getLogger(__name__)


class RpcServer:
    """Serve `handler(message, frames) -> reply | (reply, frames)` on `bind`, or
    `batch_handler([(message, frames), ...]) -> [reply | (reply, frames) | exception, ...]`.

    Give exactly one of the two. A handler may raise (a batch handler may return, per
    request) `RemoteError(code, message)` to answer with that error, or any
    `ProtocolError` (answered ``malformed``); other exceptions are answered
    ``internal``. Start with `start()` (returns the bound address;
    ``tcp://127.0.0.1:*`` picks a free port) or use as a context manager.

    `max_batch` bounds how many requests one batch handler call gets; `batch_window_s`
    (default 0: only what is already waiting) is how long to wait for more after the
    first; `max_request_bytes` (default: no limit beyond the message bounds) caps the
    bytes of one request, raw frames included (``too_large`` otherwise), and a frame of
    more than twice that is not even received (ZeroMQ's ``MAXMSGSIZE`` drops the sender
    before buffering it); `poll_s` is
    the longest the loop sleeps before it checks for `stop()`.

    Authentication (`rlax_protocol.auth`): with a credential (given, or the process's)
    only the run's roles can connect, and `permissions` says which role may send which
    message (None: any authenticated role may send anything); without one the server is
    open and refuses to bind beyond loopback unless `insecure`.

    `with_peer`: the batch handler gets ``(message, frames, peer)`` triples, `peer` the
    client's routing identity (for handlers that queue work per client). `main_work`: see
    the module docstring; it runs on the serving thread and must return within a bounded
    time.
    """

    def __init__(
        self,
        bind: str,
        handler: Handler | None = None,
        *,
        batch_handler: BatchHandler | PeerBatchHandler | None = None,
        max_batch: int = 256,
        batch_window_s: float = 0.0,
        max_request_bytes: int | None = None,
        poll_s: float = 0.05,
        server_id: str = "rlax",
        curve: CurveServerConfig | None = None,
        client_idle_timeout_s: float = 600.0,
        max_clients: int = 4096,
        permissions: Permissions | None = None,
        credential: Credential | None = None,
        insecure: bool | None = None,
        with_peer: bool = False,
        main_work: Callable[[], bool] | None = None,
    ) -> None:
        self.dispatcher = RequestDispatcher(handler, batch_handler, server_id=server_id, with_peer=with_peer)
        if max_batch < 1:
            raise ValueError(f"RpcServer: max_batch={max_batch}: must be >= 1")
        if batch_window_s < 0 or poll_s <= 0:
            raise ValueError(
                f"RpcServer: batch_window_s={batch_window_s} must be >= 0 and poll_s={poll_s} > 0"
            )
        if max_request_bytes is not None and max_request_bytes < 1:
            raise ValueError(f"RpcServer: max_request_bytes={max_request_bytes}: must be >= 1")
        self.bind = bind
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.max_request_bytes = max_request_bytes
        self.poll_s = poll_s
        self.server_id = server_id
        self.curve = curve
        self.auth = ServerAuth(
            server_id,
            permissions,
            credential=credential,
            insecure=insecure if insecure is not None else (True if curve is not None else None),
            max_message_bytes=_hard_frame_limit(max_request_bytes),
        )
        if curve is not None:
            self.auth.credential = None  # the explicit CURVE allow-list authenticates instead
        self.peers = PeerRegistry(idle_timeout_s=client_idle_timeout_s, max_peers=max_clients)
        self.address = ""
        self.main_work = main_work
        self.stats = {"requests": 0, "batches": 0, "errors": 0, "deferred": 0}
        self._deferred = DeferredReplies()
        self._context: zmq.Context[Any] = zmq.Context()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._socket: zmq.Socket[Any] | None = None
        self._auth: Any = None
        self._serving = False
        self._thread = threading.Thread(target=self._run_thread, name=f"rpc-{server_id}", daemon=True)

    def listen(self) -> str:
        """Bind now, in the calling thread (if not bound yet); returns the bound address."""
        if self._socket is None:
            socket = self._context.socket(zmq.ROUTER)
            socket.linger = 0
            try:
                self.auth.secure(self._context, socket, self.bind)
                if self.curve is not None:
                    self._auth = start_curve_server(self._context, socket, self.curve)
                socket.bind(self.bind)
            except BaseException:
                socket.close(0)
                self._stop_auth()
                raise
            self.address = socket.last_endpoint.decode()
            self._socket = socket
        return self.address

    def serve_forever(self) -> None:
        """Serve in the calling thread until `shutdown()` or `stop()` (binds first if needed).

        For handlers that must run on a particular thread (one that uses signals must
        run on the main thread); `start()` serves from a thread of its own instead.
        """
        self.listen()
        socket = self._socket
        assert socket is not None
        self._serving = True
        try:
            self._loop(socket)
        finally:
            self._serving = False
            socket.close(0)
            self._socket = None
            self._stop_auth()
            self._done.set()

    def start(self) -> str:
        """Bind and serve from a thread of its own; returns the bound address."""
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None or not self.address:
            self.stop()
            raise RuntimeError(f"{self.server_id}: could not bind {self.bind}: {self._error}")
        return self.address

    def shutdown(self) -> None:
        """Ask the loop to stop (it does within `poll_s`); safe from a signal handler."""
        self._stop.set()

    def stop(self) -> None:
        """Stop serving and release the socket; call it from a thread other than the loop's."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        elif self._serving:
            self._done.wait(10)  # `serve_forever` in another thread closes its socket
        elif self._socket is not None:  # bound but never served
            self._socket.close(0)
            self._socket = None
            self._stop_auth()
        self._deferred.close()
        self._context.term()

    def is_serving(self) -> bool:
        return self._serving

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.auth.close()

    def __enter__(self) -> RpcServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- answering

    def screen(self, request: Request, role: str = "") -> ErrorReply | Message | None:
        """The reply to a request the server answers itself (malformed, handshake, a role
        not allowed to send it), or None when the request is for the handler."""
        message = request.message
        if request.error is not None or message is None:
            return ErrorReply(code="malformed", message=bounded_text(str(request.error)))
        return self.peers.screen(
            request.identity, message, server_id=self.server_id, auth=self.auth, role=role
        )

    def answer(self, request: Request, role: str = "") -> tuple[Message, Frames]:
        """The reply to one parsed request (handshake, errors, permissions and the handler)."""
        early = self.screen(request, role)
        if early is not None:
            return early, ()
        assert request.message is not None  # screen() answered every request without one
        reply = self.dispatcher.handle([request])[0]
        return outcome_of(reply, self.server_id) if isinstance(reply, Future) else reply

    def _defer(self, identity: bytes, request_id: int, future: Future[Any]) -> None:
        """Answer when `future` is done (its callback may run in any thread)."""
        self.stats["deferred"] += 1
        self._deferred.defer(identity, request_id, future)

    def _send_finished(self, socket: zmq.Socket[Any]) -> None:
        while (finished := self._deferred.pop_finished()) is not None:
            identity, request_id, future = finished
            reply, frames = outcome_of(future, self.server_id)
            self._send(socket, identity, request_id, reply, frames)

    # -- the loop

    def _run_thread(self) -> None:
        try:
            self.listen()
        except BaseException as err:
            self._error = err
            self._ready.set()
            return
        self._ready.set()
        self.serve_forever()

    def _loop(self, socket: zmq.Socket[Any]) -> None:
        poll_ms = max(1, int(self.poll_s * 1000))
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._deferred.wake_fd, zmq.POLLIN)
        more_work = False
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(0 if more_work else poll_ms))
                if self._deferred.wake_fd in events:
                    self._deferred.clear_wakeups()
                if socket in events:
                    self._serve_batch(socket, _drain_waiting(socket, self.max_batch, self.batch_window_s))
                if self.main_work is not None:
                    more_work = self.main_work()
                self._send_finished(socket)
            except zmq.ContextTerminated:
                return
            except Exception:  # outside any one request (the socket itself): log, go on
                log.exception("%s: serve loop", self.server_id)
                self._stop.wait(self.poll_s)  # no hot loop if the error persists

    def _serve_batch(self, socket: zmq.Socket[Any], batch: list[list[zmq.Frame]]) -> None:
        """Answer every message of `batch`; whatever one does, the others are answered."""
        self.stats["requests"] += len(batch)
        todo: list[Request] = []
        for parts in batch:
            request: Request | None = None
            early: Message | None
            try:
                early = self._too_large(parts)
                if early is None:
                    request = parse_request(parts)
                    early = self.screen(request, ServerAuth.role_of(parts[1]))
            except Exception as err:  # defence in depth: parsing must never stop the loop
                log.exception("%s: could not read a request", self.server_id)
                early = internal_error(f"{type(err).__name__}: {err}")
            if early is None and request is not None:
                todo.append(request)
            else:
                # Answered at once (a Hello is not kept waiting behind the batch's work).
                reply = early if early is not None else internal_error("no reply")
                self._send(socket, _identity_of(parts), _request_id_of(parts), reply, ())
        if not todo:
            return
        self.stats["batches"] += 1
        try:
            replies = self.dispatcher.handle(todo)
        except Exception as err:  # `handle` catches the handlers' errors; this is ours
            log.exception("%s: answering a batch failed", self.server_id)
            replies = [(internal_error(f"{type(err).__name__}: {err}"), ())] * len(todo)
        for request, answer in zip(todo, replies, strict=True):
            if isinstance(answer, Future):
                self._defer(request.identity, request.request_id, answer)
            else:
                self._send(socket, request.identity, request.request_id, *answer)

    def _too_large(self, parts: list[zmq.Frame]) -> ErrorReply | None:
        if self.max_request_bytes is None:
            return None
        size = sum(len(p) for p in parts[1:])
        if size <= self.max_request_bytes:
            return None
        return ErrorReply(
            code="too_large", message=f"request of {size} bytes exceeds the limit of {self.max_request_bytes}"
        )

    def _send(
        self, socket: zmq.Socket[Any], identity: bytes, request_id: int, reply: Message, frames: Frames
    ) -> None:
        if isinstance(reply, ErrorReply):
            self.stats["errors"] += 1
        _send_reply(socket, identity, request_id, reply, frames, self.server_id)


def _drain_waiting(socket: zmq.Socket[Any], max_batch: int, window_s: float) -> list[list[zmq.Frame]]:
    """The requests already waiting (at least one: the caller polled), at most `max_batch`,
    waiting up to `window_s` for more after the first."""
    batch: list[list[zmq.Frame]] = []
    window = Deadline(window_s)
    while len(batch) < max_batch:
        try:
            batch.append(socket.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            if not batch:
                continue  # the poll said one is there: it is, or the next poll says so
            remaining = window.remaining()
            if remaining <= 0 or not socket.poll(max(1, int(remaining * 1000))):
                break
    return batch


def _send_reply(
    socket: zmq.Socket[Any], identity: bytes, request_id: int, reply: Message, frames: Frames, server_id: str
) -> None:
    """Send `reply` to client `identity`; if it cannot be built or sent, an ``internal``
    error instead, so the client is not left waiting."""
    if not identity:
        return  # nothing to address a reply to
    try:
        outgoing = reply_parts(identity, request_id, reply, frames)
    except Exception as err:  # e.g. a handler returning something that cannot be encoded
        log.exception("%s: could not build a reply", server_id)
        outgoing = reply_parts(identity, request_id, internal_error(f"{type(err).__name__}: {err}"))
    try:
        # ROUTER never blocks on send: a reply to a client that is gone is dropped.
        socket.send_multipart(outgoing, copy=False)
    except (zmq.ZMQError, TypeError, ValueError) as err:
        # A frame the socket refuses: tell the client instead of leaving it waiting.
        log.error("%s: could not send a reply: %s", server_id, err)
        error = internal_error(f"reply could not be sent: {err}")
        try:
            socket.send_multipart(reply_parts(identity, request_id, error))
        except zmq.ZMQError as again:
            log.error("%s: could not send an error reply either: %s", server_id, again)


def _hard_frame_limit(max_request_bytes: int | None) -> int | None:
    """The frame size beyond which ZeroMQ drops the sender unanswered. Twice the polite
    limit: a request a little too large still gets a ``too_large`` reply that says why."""
    return None if max_request_bytes is None else 2 * max_request_bytes + 64 * 1024


def _identity_of(parts: Sequence[zmq.Frame]) -> bytes:
    try:
        return bytes(parts[0].bytes) if parts else b""
    except Exception:
        return b""


def _request_id_of(parts: Sequence[zmq.Frame]) -> int:
    try:
        return unpack_request_id(parts[1]) if len(parts) > 1 else 0
    except Exception:
        return 0
