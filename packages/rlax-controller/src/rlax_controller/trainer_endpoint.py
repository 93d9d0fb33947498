"""The controller's ROUTER socket, where the trainer asks for batches and anyone of the
run asks for status: screening (handshake, authentication, permissions), replies, and the
one BatchRequest held until its batch is ready. What a request is answered with is the
controller's `answer` function."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from rlax_controller.error_text import describe_error
from rlax_controller.run_tally import RunTally
from rlax_core.config import RunConfig
from rlax_protocol.auth import ANY_ROLE, Permissions, ServerAuth, roles
from rlax_protocol.control_messages import (
    BatchRequest,
    NoBatchYet,
    StatusQuery,
    decode_control,
    encode_control,
)
from rlax_protocol.messages import ErrorReply, Hello, Message
from rlax_protocol.transport import PeerRegistry, pack_request_id, unpack_request_id, welcome_for

__all__ = ["BATCH_HOLD_S", "CONTROLLER_PERMISSIONS", "MAX_CONTROLLER_REQUEST_BYTES", "TrainerEndpoint"]

log = logging.getLogger("rlax.controller")

CONTROLLER_PERMISSIONS: Permissions = {
    BatchRequest: roles("trainer"),
    StatusQuery: roles(ANY_ROLE),
}
"""Who may ask the controller what when the run authenticates: only the trainer asks for
batches (a BatchRequest moves the run to its step), anyone of the run asks for status."""

MAX_CONTROLLER_REQUEST_BYTES = 4 * 1024 * 1024
"""Largest frame the controller receives (a BatchRequest with its metrics is a few KB)."""

# How long the controller holds a trainer's BatchRequest waiting for the batch; well under
# the trainer's client timeout (>= 1 s), so a held request never looks like a lost one.
BATCH_HOLD_S = 0.5
REPLY_LINGER_MS = 2000


class TrainerEndpoint:
    """Binds `config.controller.address`. `answer` answers a screened request; `may_hold`
    says whether a BatchRequest answered `NoBatchYet` may be held (not before the run is
    restored: the first request restores it and starts the dispatch)."""

    def __init__(
        self,
        config: RunConfig,
        *,
        context: zmq.Context[Any],
        answer: Callable[[Message], Message],
        may_hold: Callable[[], bool],
        tally: RunTally,
    ) -> None:
        self.config = config
        self._answer = answer
        self._may_hold = may_hold
        self.tally = tally
        self.server_id = uuid.uuid4().hex[:12]
        self.socket = context.socket(zmq.ROUTER)
        self.socket.linger = 0
        # Only the run's roles connect (when it authenticates); only its trainer asks for batches.
        self.auth = ServerAuth(
            "controller", CONTROLLER_PERMISSIONS, max_message_bytes=MAX_CONTROLLER_REQUEST_BYTES
        )
        self.auth.secure(context, self.socket, config.controller.address)
        self.socket.bind(config.controller.address)
        self.peers = PeerRegistry(idle_timeout_s=3600.0, max_peers=1024)
        # The trainer's BatchRequest held until a batch is ready: identity, request id, request, since.
        self._held: tuple[bytes, int, BatchRequest, float] | None = None

    def serve(self) -> None:
        """Answers (or holds) every request waiting on the socket."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
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
                self.tally.count("malformed_requests")
                self._reply(identity, 0, ErrorReply(code="malformed", message=describe_error(error)))
                continue
            screened = self.peers.screen(
                identity,
                message,
                server_id=self.server_id,
                auth=self.auth,
                role=ServerAuth.role_of(frames[1]),
            )
            if screened is not None:
                # Not a run counter: a restarted trainer's first request is screened too,
                # and a run's counters must not depend on who restarted when.
                self._reply(identity, request_id, screened)
                continue
            may_hold = self._may_hold()  # asked before answering: the first request restores
            reply = self.answer(message)
            if may_hold and isinstance(message, BatchRequest) and isinstance(reply, NoBatchYet):
                # Held until the batch is ready (or BATCH_HOLD_S): the trainer gets it the
                # moment its last group is scored instead of at its next poll.
                if self._held is not None:
                    self._reply(
                        self._held[0], self._held[1], NoBatchYet(reason="superseded", retry_after_s=0.0)
                    )
                self._held = (identity, request_id, message, time.monotonic())
                continue
            self._reply(identity, request_id, reply)

    def answer(self, message: Message) -> Message:
        """The reply to a screened request; an error in answering it is the reply, not the
        controller's end."""
        if isinstance(message, Hello):
            return welcome_for(message, server_id=self.server_id)
        try:
            return self._answer(message)
        except Exception as error:  # a bad request must not stop the controller
            log.exception("error handling %s", type(message).__name__)
            return ErrorReply(code="internal", message=describe_error(error))

    def answer_held(self, now: float) -> None:
        """Ask the held BatchRequest again; reply once there is a batch (or another answer),
        or `NoBatchYet` with no delay once it has waited BATCH_HOLD_S."""
        if self._held is None:
            return
        identity, request_id, request, since = self._held
        reply = self.answer(request)
        if isinstance(reply, NoBatchYet):
            if now - since < min(BATCH_HOLD_S, self.config.controller.request_timeout_s / 4):
                return
            reply = NoBatchYet(reason=reply.reason, retry_after_s=0.0)
        self._held = None
        self._reply(identity, request_id, reply)

    def _reply(self, identity: bytes, request_id: int, message: Message) -> None:
        try:
            self.socket.send_multipart(
                [identity, pack_request_id(request_id), encode_control(message)], zmq.NOBLOCK
            )
        except zmq.Again:
            log.warning("dropped a reply to a peer whose queue is full")

    def close(self) -> None:
        """Stop serving. A held BatchRequest is answered first (`NoBatchYet`, retry soon): a
        controller that stops while it holds one (the run's end, a config error found by the
        dispatch) would otherwise leave the trainer waiting out its whole timeout.

        Every reply already queued is still delivered: a `NoBatchYet` sent a moment before a
        config error stopped the run was dropped by a socket closed without lingering (under
        the full suite's load its I/O thread had not written it yet; the trainer's request
        then timed out instead of seeing the controller stop)."""
        if self._held is not None:
            identity, request_id, _, _ = self._held
            self._held = None
            self._reply(
                identity, request_id, NoBatchYet(reason="the controller is stopping", retry_after_s=0.5)
            )
        # ms: the most the queued replies may wait to reach the kernel (only until they are
        # sent; a reply to a peer that is gone is dropped at once). 200 ms lost a held reply
        # once under a loaded 2-core machine.
        self.socket.close(linger=REPLY_LINGER_MS)
        self.auth.close()
