"""Typed wire messages of RLAX (docs/design.md, "Messages: the wire protocol").

Every message is a frozen, tagged `msgspec.Struct` encoded with msgpack; the tag (the
class name, in field ``type``) tells one message type from another, so a single
decoder reads any of them and a message of the wrong type is an error, not a guess.
Tensors never travel inside these structs: a `TensorManifest` describes them and the
bytes follow as raw frames (see `rlax_protocol.codec`).

This module holds the handshake and the registry: the messages themselves live by
family in `tensor_messages`, `paramserver_messages`, `generation_messages` and
`verifier_messages` (their base in `message_base`) and are re-exported here, so
`rlax_protocol.messages` still names every one of them.

`Hello` and `Welcome` must keep their tag and fields forever: they are what two peers
of different protocol versions still understand, so that a mismatch can be reported.
"""

from __future__ import annotations

from typing import Any, TypeVar, Union

import msgspec

from rlax_protocol.bounds import MAX_MESSAGE_BYTES, MAX_MESSAGE_DEPTH, check_msgpack_bounds
from rlax_protocol.errors import MalformedMessageError
from rlax_protocol.generation_messages import (
    AgentSpec,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ResumedSample,
    Rollout,
    Sample,
    SamplingParams,
    TrajectoryEnd,
    WorkerStats,
)
from rlax_protocol.message_base import PROTOCOL_VERSION, Message
from rlax_protocol.paramserver_messages import (
    Chunks,
    Committed,
    FetchChunks,
    LatestQuery,
    LatestVersion,
    Metadata,
    NotNewer,
    PullBegin,
    PullEnd,
    PullGranted,
    PushAbort,
    PushBegin,
    PushChunks,
    PushCommit,
    PushReady,
    ServerStats,
    StatQuery,
    WaitNewer,
)
from rlax_protocol.tensor_messages import DTYPE_ITEMSIZE, MAX_RANK, TensorHeader, TensorManifest
from rlax_protocol.verifier_messages import (
    MAX_ENV_TURNS,
    EnvStepRequest,
    EnvStepResult,
    VerifyBatch,
    VerifyBatchResult,
    VerifyRequest,
    VerifyResult,
)

__all__ = [
    "Ack",
    "AgentSpec",
    "AnyMessage",
    "Chunks",
    "Committed",
    "DTYPE_ITEMSIZE",
    "EnvStepRequest",
    "EnvStepResult",
    "ErrorReply",
    "FetchChunks",
    "FinishReason",
    "GenerateRequest",
    "ResumedSample",
    "GenerateResult",
    "Hello",
    "LatestQuery",
    "LatestVersion",
    "MAX_ENV_TURNS",
    "MAX_RANK",
    "Message",
    "Metadata",
    "NotNewer",
    "PROTOCOL_VERSION",
    "PullBegin",
    "PullEnd",
    "PullGranted",
    "PushAbort",
    "PushBegin",
    "PushChunks",
    "PushCommit",
    "PushReady",
    "Rollout",
    "Sample",
    "SamplingParams",
    "ServerStats",
    "StatQuery",
    "TensorHeader",
    "TensorManifest",
    "TrajectoryEnd",
    "VerifyBatch",
    "VerifyBatchResult",
    "VerifyRequest",
    "VerifyResult",
    "WaitNewer",
    "Welcome",
    "WorkerStats",
    "decode",
    "decode_as",
    "encode",
]

# --------------------------------------------------------------------------- handshake


class Hello(Message, frozen=True):
    """First message from a client on a new connection."""

    protocol_version: int
    client_id: str = ""
    role: str = ""


class Welcome(Message, frozen=True):
    """Server's answer to `Hello`; `accepted` is False when the versions differ."""

    protocol_version: int
    server_id: str = ""
    accepted: bool = True
    reason: str = ""


class ErrorReply(Message, frozen=True):
    """Answer to a request that could not be served. `code` is machine-readable
    (``malformed``, ``unknown_message``, ``version_mismatch``, ``not_found``, ``stale_version``,
    ``too_large``, ``out_of_order``, ``checksum``, ``handshake_required``, ``forbidden``: the
    sender's role may not send this, ``busy``: retry later or elsewhere, ``version_unavailable``:
    a worker could not get the asked weight version within its limit, ``internal``)."""

    code: str
    message: str


class Ack(Message, frozen=True):
    """Plain success answer carrying no data."""


AnyMessage = Union[  # noqa: UP007 - msgspec needs a runtime Union object here
    Hello,
    Welcome,
    ErrorReply,
    Ack,
    TensorHeader,
    TensorManifest,
    PushBegin,
    PushReady,
    PushChunks,
    PushCommit,
    PushAbort,
    Committed,
    PullBegin,
    PullGranted,
    NotNewer,
    FetchChunks,
    Chunks,
    PullEnd,
    LatestQuery,
    WaitNewer,
    LatestVersion,
    StatQuery,
    ServerStats,
    SamplingParams,
    AgentSpec,
    ResumedSample,
    GenerateRequest,
    Sample,
    WorkerStats,
    GenerateResult,
    Rollout,
    VerifyRequest,
    VerifyResult,
    VerifyBatch,
    VerifyBatchResult,
    EnvStepRequest,
    EnvStepResult,
]

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(AnyMessage)

M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    """msgpack bytes of `message` (its tag included)."""
    return _encoder.encode(message)


def decode(
    data: bytes | memoryview | bytearray,
    *,
    max_depth: int = MAX_MESSAGE_DEPTH,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Message:
    """Decode any RLAX message; never raises anything but `MalformedMessageError`.

    The bytes are first checked (iteratively) for nesting deeper than `max_depth`, a
    size above `max_bytes` and impossible declared lengths, because msgspec recurses
    into nested values and would otherwise exhaust the stack (`RecursionError`) or try
    to allocate what a hostile length prefix claims.
    """
    check_msgpack_bounds(data, max_depth=max_depth, max_bytes=max_bytes)
    try:
        message: Message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise MalformedMessageError(f"cannot decode message ({len(data)} bytes): {err}") from None
    except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as err:
        # Defence in depth: the bounds above should make these unreachable.
        raise MalformedMessageError(
            f"cannot decode message ({len(data)} bytes): {type(err).__name__}: {err}"
        ) from None
    return message


def decode_as(data: bytes | memoryview | bytearray, expected: type[M] | tuple[type[M], ...]) -> M:
    """Decode and require one of the `expected` types, else `MalformedMessageError` naming both."""
    message = decode(data)
    if not isinstance(message, expected):
        names = expected.__name__ if isinstance(expected, type) else " or ".join(t.__name__ for t in expected)
        raise MalformedMessageError(f"expected {names}, got {type(message).__name__}")
    return message
