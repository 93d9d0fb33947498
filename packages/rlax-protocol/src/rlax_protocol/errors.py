"""Error types of the RLAX wire protocol.

Every failure a peer can cause (bad bytes, wrong version, corrupt tensor, silence)
raises a subclass of `ProtocolError`, so a server can catch one type, answer with an
`ErrorReply` and keep serving.
"""

from __future__ import annotations

import builtins


class ProtocolError(Exception):
    """Base class of every error raised by `rlax_protocol`."""


class MalformedMessageError(ProtocolError):
    """Bytes that are not a valid message of the expected type (garbage, truncated, wrong type)."""


class VersionMismatchError(ProtocolError):
    """The two peers speak different protocol versions; the message names both."""

    def __init__(self, local: int, remote: int, *, peer: str = "peer") -> None:
        self.local = local
        self.remote = remote
        self.peer = peer
        super().__init__(
            f"protocol version mismatch: this side speaks version {local}, {peer} speaks version {remote}"
        )


class ChecksumError(ProtocolError):
    """A tensor's bytes do not match the checksum in its header; the message names the tensor."""

    def __init__(self, tensor: str, expected: int, actual: int) -> None:
        self.tensor = tensor
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"checksum mismatch for tensor {tensor!r}: header says {expected:#018x}, bytes hash to {actual:#018x}"
        )


class RemoteError(ProtocolError):
    """The peer answered with an `ErrorReply`; carries its code and message."""

    def __init__(self, code: str, message: str, *, peer: str = "peer") -> None:
        self.code = code
        self.remote_message = message
        self.peer = peer
        super().__init__(f"{peer} replied with error {code!r}: {message}")


class ProtocolTimeoutError(ProtocolError, builtins.TimeoutError):
    """A send or receive missed its deadline; names the peer and the operation."""

    def __init__(self, peer: str, operation: str, timeout_s: float, *, attempts: int = 1) -> None:
        self.peer = peer
        self.operation = operation
        self.timeout_s = timeout_s
        self.attempts = attempts
        tries = "" if attempts == 1 else f" (after {attempts} attempts)"
        super().__init__(f"timed out after {timeout_s:.3g}s waiting for {operation} with {peer}{tries}")
