"""The verifier's end of the two pipes to a sandboxed job, and the judge that runs
assert-style test scripts outside the sandbox.

Replies are decoded with the standard JSON parser into built-in types (`plain_values`);
nothing the program created ever reaches this process as an object.
"""

from __future__ import annotations

import builtins
import functools
import importlib.util
import json
import os
import select
import time
import traceback
import types
import zlib
from typing import Any

from rlax_data.verify.plain_values import from_plain, to_plain

__all__ = ["Channel", "Stopped", "run_script"]


class Stopped(BaseException):
    """The job cannot answer any more (it exited, hit the deadline, or sent garbage).

    A BaseException so that a test script's `except Exception` cannot swallow it; the
    channel also remembers it, so even a bare `except:` does not make the job pass."""


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


class SolutionRaised(Exception):
    """The solution raised an exception that is not a built-in one."""


def exception_for(reply: dict[str, Any]) -> BaseException:
    """The exception a failed call raises in the judge: the built-in class of that name
    (so tests that expect, say, a ValueError still work), else `SolutionRaised`."""
    kind = getattr(builtins, str(reply.get("type")), None)
    message = str(reply.get("error", ""))[-500:]
    if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
        try:
            return kind(message)
        except Exception:
            pass
    return SolutionRaised(message)


@functools.lru_cache(maxsize=2048)
def _compiled(source: str, filename: str) -> types.CodeType:
    return compile(source, filename, "exec")


def _private_random(seed: int) -> types.ModuleType:
    """A fresh copy of the `random` module, seeded: scripts that draw random tests get the
    same tests for every sample, and the verifier's own `random` state is left alone."""
    spec = importlib.util.find_spec("random")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.seed(seed)
    return module


def _judge_builtins(seed: int) -> dict[str, Any]:
    private: dict[str, types.ModuleType] = {}
    real_import = builtins.__import__

    def judge_import(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        if name == "random" and level == 0:
            if "random" not in private:
                private["random"] = _private_random(seed)
            return private["random"]
        return real_import(name, globals, locals, fromlist, level)

    table = dict(vars(builtins))
    table["__import__"] = judge_import
    return table


def run_script(prelude: str, script: str, entry_point: str | None, channel: Channel) -> str:
    """Run the dataset's test `script` here, outside the sandbox, after its `prelude` (the
    problem's own helper code), with `entry_point` bound to a stand-in that asks the job
    to make the call and returns the plain value it sent back. "" when it passed, else
    why not. `Stopped` propagates: the job ended before its tests did."""
    seed = zlib.crc32(script.encode())
    namespace: dict[str, Any] = {"__name__": "__rlax_tests__", "__builtins__": _judge_builtins(seed)}

    def candidate(*args: Any, **kwargs: Any) -> Any:
        reply = channel.call(args, kwargs)
        if "value" in reply:
            return reply["value"]
        raise exception_for(reply)

    try:
        if prelude:
            exec(_compiled(prelude, "<prelude>"), namespace)
    except Exception:
        return "the tests' prelude failed: " + traceback.format_exc(limit=-2)[-1500:]
    if entry_point:
        namespace[entry_point] = candidate
    try:
        exec(_compiled(script, "<tests>"), namespace)
        error = ""
    except Stopped:
        raise
    except BaseException as e:
        error = _short_traceback(e)
    if channel.stopped:
        raise Stopped(channel.stopped)
    return error


def _short_traceback(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<tests>"]
    where = f" (tests line {frames[-1].lineno})" if frames else ""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return (text + where)[-2000:]
