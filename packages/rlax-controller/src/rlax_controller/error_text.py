"""How the controller words an error in its logs and error replies."""

from __future__ import annotations

from rlax_protocol.errors import MalformedMessageError

__all__ = ["describe_error"]


def describe_error(error: BaseException) -> str:
    """A malformed message's own text (it already says what was wrong), else the type and text."""
    return str(error) if isinstance(error, MalformedMessageError) else f"{type(error).__name__}: {error}"
