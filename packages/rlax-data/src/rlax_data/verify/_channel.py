"""The verifier's end of the two pipes to a sandboxed process.

Replies are decoded with the standard JSON parser into built-in types (`plain_values`);
nothing the program created ever reaches the verifier as an object.
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

from rlax_data.verify.plain_values import from_plain, to_plain

__all__ = ["Channel", "Stopped"]


class Stopped(BaseException):
    """The job cannot answer any more (it exited, hit the deadline, or sent garbage).

    A BaseException so that no `except Exception` on the way swallows it; the channel
    also remembers it (`stopped`), and every later call raises it again."""


class Channel:
    """Sends requests to the job and reads its JSON-line replies before a deadline."""

    def __init__(self, request_fd: int, reply_fd: int, pidfd: int, deadline: float, max_bytes: int) -> None:
        self.request_fd = request_fd
        self.reply_fd = reply_fd
        self.pidfd = pidfd
        self.deadline = deadline
        self.max_bytes = max_bytes
        self.stopped: str | None = None
        self.timed_out = False
        self._buf = b""
        os.set_blocking(request_fd, False)
        os.set_blocking(reply_fd, False)

    def _stop(self, why: str) -> Stopped:
        self.stopped = self.stopped or why
        return Stopped(self.stopped)

    def _wait(self, fd: int, write: bool) -> bool:
        """Wait until `fd` is ready; False when the job exited first."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.timed_out = True
            raise self._stop("deadline")
        rlist, wlist, _ = select.select(
            [self.pidfd] + ([] if write else [fd]), [fd] if write else [], [], left
        )
        if fd in rlist or fd in wlist:
            return True
        if self.pidfd in rlist:
            return False
        self.timed_out = True
        raise self._stop("deadline")

    def send(self, obj: dict[str, Any]) -> None:
        if self.stopped:
            raise Stopped(self.stopped)
        data = memoryview((json.dumps(obj, allow_nan=False) + "\n").encode())
        while data:
            if not self._wait(self.request_fd, write=True):
                raise self._stop("exited")
            try:
                data = data[os.write(self.request_fd, data) :]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise self._stop("exited") from None

    def recv(self) -> dict[str, Any]:
        if self.stopped:
            raise Stopped(self.stopped)
        while b"\n" not in self._buf:
            alive = self._wait(self.reply_fd, write=False)
            try:
                chunk = os.read(self.reply_fd, 1 << 16)
            except BlockingIOError:
                chunk = None
            if not chunk:
                if chunk is None and alive:
                    continue
                raise self._stop("exited")
            self._buf += chunk
            if len(self._buf) > self.max_bytes:
                raise self._stop(f"a reply longer than {self.max_bytes} bytes")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = json.loads(line, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            raise self._stop("a malformed reply") from None
        if type(reply) is not dict:
            raise self._stop("a malformed reply")
        return reply

    def call(self, args: list[Any] | tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """One call of the entry point: the reply with "value" decoded, or its error."""
        self.send({"args": to_plain(list(args)), "kwargs": to_plain(dict(kwargs))})
        reply = self.recv()
        if "value" in reply:
            try:
                reply["value"] = from_plain(reply["value"])
            except (ValueError, TypeError, RecursionError) as e:
                raise self._stop(f"a malformed value ({e})") from None
        elif type(reply.get("error")) is not str:
            raise self._stop("a malformed reply")
        return reply


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
