"""The errors a parameter-server client raises for the server's error codes, so callers
can tell a stale push, a missing version and an expired lease apart."""

from __future__ import annotations

from rlax_protocol import RemoteError


class StaleVersionError(RemoteError):
    """The pushed version is not newer than the server's latest."""


class VersionNotFoundError(RemoteError):
    """The requested version is not held (never pushed, or already freed)."""


class LeaseExpiredError(RemoteError):
    """The server dropped this pull's lease (the pull was too slow or the server restarted)."""


def typed_error(err: RemoteError) -> RemoteError:
    """`err` as the error class its code stands for (itself when none does)."""
    if err.code == "stale_version":
        return StaleVersionError(err.code, err.remote_message, peer=err.peer)
    if err.code == "not_found" and "lease" in err.remote_message:
        return LeaseExpiredError(err.code, err.remote_message, peer=err.peer)
    if err.code == "not_found":
        return VersionNotFoundError(err.code, err.remote_message, peer=err.peer)
    return err
