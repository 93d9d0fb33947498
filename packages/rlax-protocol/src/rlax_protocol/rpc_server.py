"""A small request/reply server for RLAX services (verifier service, workers' control ports).

`RpcServer` binds a ROUTER socket, runs the handshake (`Hello` -> `Welcome`, refusing
other protocol versions), and hands every other request to one handler function in
its own thread. Anything malformed or unexpected is answered with an `ErrorReply` and
the server keeps serving; a handler exception becomes an ``internal`` error reply.
For high-throughput byte movement see how `rlax_paramserver` adds worker threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from rlax_protocol.errors import ProtocolError, RemoteError
from rlax_protocol.messages import ErrorReply, Hello, Message
from rlax_protocol.transport import (
    CurveServerConfig,
    PeerRegistry,
    Request,
    parse_request,
    reply_parts,
    start_curve_server,
    welcome_for,
)

log = logging.getLogger(__name__)

Frames = Sequence[bytes | memoryview | zmq.Frame]
HandlerResult = Message | tuple[Message, Frames]
Handler = Callable[[Message, list[zmq.Frame]], HandlerResult]


class RpcServer:
    """Serve `handler(message, frames) -> reply | (reply, frames)` on `bind`.

    The handler may raise `RemoteError(code, message)` to answer with that error, or
    any `ProtocolError` (answered ``malformed``). Start with `start()` (returns the bound
    address; ``tcp://127.0.0.1:*`` picks a free port) or use as a context manager.
    """

    def __init__(
        self,
        bind: str,
        handler: Handler,
        *,
        server_id: str = "rlax",
        curve: CurveServerConfig | None = None,
        client_idle_timeout_s: float = 600.0,
        max_clients: int = 4096,
    ) -> None:
        self.bind = bind
        self.handler = handler
        self.server_id = server_id
        self.curve = curve
        self.peers = PeerRegistry(idle_timeout_s=client_idle_timeout_s, max_peers=max_clients)
        self.address = ""
        self._context: zmq.Context[Any] = zmq.Context()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"rpc-{server_id}", daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None or not self.address:
            self.stop()
            raise RuntimeError(f"{self.server_id}: could not bind {self.bind}: {self._error}")
        return self.address

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._context.term()

    def __enter__(self) -> RpcServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answer(self, request: Request) -> tuple[Message, Frames]:
        """The reply to one parsed request (handshake, errors and the handler)."""
        message = request.message
        if request.error is not None or message is None:
            return ErrorReply(code="malformed", message=str(request.error)), ()
        if isinstance(message, Hello):
            welcome = welcome_for(message, server_id=self.server_id)
            if welcome.accepted:
                self.peers.admit(request.identity, message.client_id)
            return welcome, ()
        if not self.peers.touch(request.identity):
            return ErrorReply(
                code="handshake_required", message="say Hello (with the protocol version) first"
            ), ()
        try:
            result = self.handler(message, request.frames)
        except RemoteError as err:
            return ErrorReply(code=err.code, message=err.remote_message), ()
        except ProtocolError as err:
            return ErrorReply(code="malformed", message=str(err)), ()
        except Exception as err:  # one bad request must not stop the service
            log.exception("%s: handler failed on %s", self.server_id, type(message).__name__)
            return ErrorReply(code="internal", message=f"{type(err).__name__}: {err}"), ()
        return result if isinstance(result, tuple) else (result, ())

    def _serve(self) -> None:
        socket = self._context.socket(zmq.ROUTER)
        socket.linger = 0
        auth = None
        try:
            if self.curve is not None:
                auth = start_curve_server(self._context, socket, self.curve)
            socket.bind(self.bind)
            self.address = socket.last_endpoint.decode()
        except BaseException as err:
            self._error = err
            socket.close(0)
            if auth is not None:
                auth.stop()
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not socket.poll(50):
                    continue
                self._serve_one(socket, socket.recv_multipart(copy=False))
        finally:
            socket.close(0)
            if auth is not None:
                auth.stop()

    def _serve_one(self, socket: zmq.Socket[Any], parts: list[zmq.Frame]) -> None:
        """Answer one message; whatever it does, the loop goes on to the next one."""
        request = parse_request(parts)
        try:
            reply, frames = self.answer(request)
            outgoing = reply_parts(request.identity, request.request_id, reply, frames)
        except Exception as err:  # e.g. a handler returning something that cannot be encoded
            log.exception("%s: could not build a reply", self.server_id)
            error = ErrorReply(code="internal", message=f"{type(err).__name__}: {err}")
            outgoing = reply_parts(request.identity, request.request_id, error)
        try:
            socket.send_multipart(outgoing, copy=False)
        except (zmq.ZMQError, TypeError, ValueError) as err:
            # A frame the socket refuses: tell the client instead of leaving it waiting.
            log.error("%s: could not send a reply: %s", self.server_id, err)
            error = ErrorReply(code="internal", message=f"reply could not be sent: {err}")
            try:
                socket.send_multipart(reply_parts(request.identity, request.request_id, error))
            except zmq.ZMQError as again:
                log.error("%s: could not send an error reply either: %s", self.server_id, again)
