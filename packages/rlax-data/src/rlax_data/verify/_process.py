"""One sandboxed process as the verifier holds it: started, talked to, stopped.

The process runs the runner (`_harness.py`); it gets three pipes (requests in, replies
out, and its supervisor's exit report) and in-memory files for stdin, stdout and stderr
(their size is capped by the job's RLIMIT_FSIZE).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rlax_data.verify._channel import Channel

__all__ = ["Ending", "JobProcess"]


class Ending:
    """How a process ended: `by_itself` (before we stopped it), the wrapper's exit status
    `returncode`, the supervisor's report `program` (exit status of the program, CPU
    seconds it used; None without a report), and its output."""

    def __init__(
        self, by_itself: bool, returncode: int, program: tuple[int, float] | None, stdout: str, stderr: str
    ):
        self.by_itself = by_itself
        self.returncode = returncode
        self.program = program
        self.stdout = stdout
        self.stderr = stderr


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


class JobProcess:
    """Starts `argv_for(request_fd, reply_fd, status_fd)` as `uid` (None: ours) and keeps
    the verifier's ends of its pipes; `stop()` kills what is left and reports, `close()`
    releases everything."""

    def __init__(
        self,
        argv_for: Callable[[int, int, int], list[str]],
        *,
        uid: int | None,
        stdin: bytes,
        deadline: float,
        max_bytes: int,
        env: dict[str, str],
        cwd: str,
        workdir: str | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.workdir = workdir
        self._fds: list[int] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.stdin_fd, self.stdout_fd, self.stderr_fd = (
            _memfd("stdin", stdin),
            _memfd("stdout"),
            _memfd("stderr"),
        )
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self.status_r, status_w = os.pipe()
        self._fds += [self.stdin_fd, self.stdout_fd, self.stderr_fd, request_w, reply_r, self.status_r]
        child_ends = (request_r, reply_w, status_w)
        try:
            self.proc = subprocess.Popen(
                argv_for(request_r, reply_w, status_w), stdin=self.stdin_fd, stdout=self.stdout_fd, stderr=self.stderr_fd, pass_fds=child_ends,
                cwd=cwd, env=env, start_new_session=True,
                user=uid, group=uid, extra_groups=[] if uid is not None else None,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        finally:
            for fd in child_ends:
                os.close(fd)
        self.pidfd = os.pidfd_open(self.proc.pid)
        self._fds.append(self.pidfd)
        self.chan = Channel(request_w, reply_r, self.pidfd, deadline, max_bytes)

    def stop(self) -> Ending:
        """Kill what is left of the process tree, reap it, and say how it ended."""
        assert self.proc is not None
        # A closed reply pipe means the job's processes are gone: give the wrapper a
        # moment to report how its child ended.
        grace = (
            min(2.0, max(0.0, self.chan.deadline - time.monotonic()))
            if self.chan.stopped == "exited"
            else 0.0
        )
        by_itself = bool(select.select([self.pidfd], [], [], grace)[0])
        returncode = _finish(self.proc)
        program = _read_status(self.status_r) if by_itself else None
        stdout = os.pread(self.stdout_fd, self.max_bytes, 0).decode("utf-8", "replace")
        stderr = os.pread(self.stderr_fd, self.max_bytes, 0).decode("utf-8", "replace")
        return Ending(by_itself, returncode, program, stdout, stderr)

    def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            _finish(self.proc)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _read_status(fd: int) -> tuple[int, float] | None:
    """The program's exit status and CPU seconds, as the job's supervisor reported them."""
    os.set_blocking(fd, False)
    try:
        report = json.loads(os.read(fd, 4096))
        code, cpu_s = report["exit"], report["cpu_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if type(code) is not int or type(cpu_s) not in (int, float):
        return None
    return code, float(cpu_s)


def _finish(proc: subprocess.Popen[bytes]) -> int:
    """Kill what is left of the job and reap it; the wrapper's exit status. (How the
    program itself ended, and its CPU time, come from the job's supervisor: bubblewrap
    does not wait for its child, so its rusage says nothing.)"""
    # bubblewrap's child is the pid namespace's init: once it has exited, the kernel has
    # killed and reaped every process of the namespace. Wait for that, so that nothing
    # of the job outlives this call.
    init_pidfds = []
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        init_pidfds = [os.pidfd_open(int(pid)) for pid in children]
    except OSError:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pidfd in init_pidfds:
        select.select([pidfd], [], [], 10.0)
        os.close(pidfd)
    return proc.returncode
