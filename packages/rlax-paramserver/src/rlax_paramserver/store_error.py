"""The error the parameter server's store refuses a request with (its own module so that
the store's parts can raise it without importing the store)."""

from __future__ import annotations


class StoreError(Exception):
    """A request the store refuses; `code` becomes the `ErrorReply` code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
