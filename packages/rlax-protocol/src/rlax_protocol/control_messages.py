"""Controller <-> trainer messages, on top of `rlax_protocol`'s rules and framing.

Same rules as the wire protocol (docs/design.md, "Messages: the wire protocol"): frozen, tagged `msgspec.Struct`s in
msgpack, a `Hello`/`Welcome` handshake carrying the protocol version, `ErrorReply` for a
bad request, every receive with a deadline. The trainer *pulls*: it asks for the batch of
the step its newest checkpoint is at, which also tells the controller which steps are
done — so neither side keeps connection state that a crash could lose.

    trainer -> controller: BatchRequest(trainer_step=s, metrics of step s)
    controller -> trainer: TrainBatch(step=s, ...) | NoBatchYet | RunComplete | ErrorReply
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from rlax_protocol.bounds import check_msgpack_bounds
from rlax_protocol.errors import MalformedMessageError
from rlax_protocol.messages import Ack, ErrorReply, Hello, Message, Rollout, Welcome

__all__ = [
    "BatchRequest",
    "ControlMessage",
    "NoBatchYet",
    "RunComplete",
    "RunStatus",
    "StatusQuery",
    "TrainBatch",
    "decode_control",
    "encode_control",
]


class BatchRequest(Message, frozen=True):
    """The trainer holds weights of version `trainer_step` and asks for that step's batch.
    `metrics`: figures of the step it just finished (empty after a restart)."""

    trainer_step: int
    metrics: dict[str, float] = {}
    trainer_id: str = ""

    def __post_init__(self) -> None:
        if self.trainer_step < 0:
            raise ValueError(f"BatchRequest.trainer_step={self.trainer_step}: must be >= 0")


class TrainBatch(Message, frozen=True):
    """The rollouts of step `step` (groups of `group_size`, in stream order), each with the
    id the controller tracks it by."""

    step: int
    group_size: int
    rollouts: tuple[Rollout, ...]
    rollout_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.rollout_ids) != len(self.rollouts):
            raise ValueError(
                f"TrainBatch.rollout_ids has {len(self.rollout_ids)} ids for {len(self.rollouts)} rollouts"
            )
        if self.group_size <= 0 or len(self.rollouts) % self.group_size:
            raise ValueError(
                f"TrainBatch.group_size={self.group_size}: {len(self.rollouts)} rollouts are not whole groups"
            )


class NoBatchYet(Message, frozen=True):
    """Ask again after `retry_after_s` (rollouts still being generated or scored)."""

    reason: str
    retry_after_s: float = 0.05


class RunComplete(Message, frozen=True):
    """The run reached its last step; the trainer exits."""

    final_step: int


class StatusQuery(Message, frozen=True):
    pass


class RunStatus(Message, frozen=True):
    step: int
    total_steps: int
    workers_alive: int
    counters: dict[str, int]
    finished: bool


ControlMessage = Union[  # noqa: UP007 - msgspec needs a runtime Union object here
    Hello, Welcome, ErrorReply, Ack, BatchRequest, TrainBatch, NoBatchYet, RunComplete, StatusQuery, RunStatus
]

# A TrainBatch of a large run (hundreds of rollouts of thousands of tokens, each with its
# logprob) can pass the protocol's 64 MB default; its nesting depth stays 4.
_MAX_CONTROL_BYTES = 1 << 30

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ControlMessage)


def encode_control(message: Message) -> bytes:
    return _encoder.encode(message)


def decode_control(data: bytes | memoryview | bytearray) -> Message:
    """Decode a controller message; garbage or a wrong field raises `MalformedMessageError`.
    Depth and declared lengths are checked first: msgspec recurses into nested values."""
    check_msgpack_bounds(data, max_bytes=_MAX_CONTROL_BYTES)
    try:
        message: Message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise MalformedMessageError(
            f"cannot decode controller message ({len(data)} bytes): {error}"
        ) from None
    return message
