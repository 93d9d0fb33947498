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

__all__ = ["Ending", "JobProcess", "await_uid_gone", "processes_of"]


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
    releases everything. `pid_namespace`: the process is bubblewrap, whose one child is
    the init of the job's pid namespace (otherwise the job is its process group)."""

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
        pid_namespace: bool = False,
    ) -> None:
        self.max_bytes = max_bytes
        self.pid_namespace = pid_namespace
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
        returncode = _finish(self.proc, self.pid_namespace)
        program = _read_status(self.status_r) if by_itself else None
        stdout = os.pread(self.stdout_fd, self.max_bytes, 0).decode("utf-8", "replace")
        stderr = os.pread(self.stderr_fd, self.max_bytes, 0).decode("utf-8", "replace")
        return Ending(by_itself, returncode, program, stdout, stderr)

    def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            _finish(self.proc, self.pid_namespace)
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


def _finish(proc: subprocess.Popen[bytes], pid_namespace: bool) -> int:
    """Kill what is left of the job, wait until none of its processes is left, and reap
    it; the wrapper's exit status. (How the program itself ended, and its CPU time, come
    from the job's supervisor: bubblewrap does not wait for its child, so its rusage says
    nothing.)"""
    deadline = time.monotonic() + _REAP_S
    while pid_namespace and proc.poll() is None and time.monotonic() < deadline:
        # bubblewrap's child is the pid namespace's init: once it is killed, the kernel
        # kills every other process of the namespace and lets init exit only when they
        # are all reaped. Kill init first and let bubblewrap, its parent, reap it and exit:
        # bubblewrap killed first would leave init to the host's init (a process of the
        # job's uid that outlives this call, for as long as the host takes to reap it).
        inits = _children(proc.pid)
        if not inits:
            time.sleep(0.001)  # bubblewrap has not started it yet, or is about to exit
            continue
        for init in inits:
            try:
                signal.pidfd_send_signal(init, signal.SIGKILL)
                select.select([init], [], [], max(0.0, deadline - time.monotonic()))
            except ProcessLookupError:
                pass
            finally:
                os.close(init)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    if proc.returncode is None:
        # A plain process job (its process group), or a bubblewrap that did not exit with
        # its child.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return proc.returncode


# How long stopping a job may wait for its processes to go (they are SIGKILLed: the
# kernel's time to tear down a large address space, on a loaded host).
_REAP_S = 10.0


def _children(pid: int) -> list[int]:
    """pidfds of `pid`'s children (bubblewrap has one: the job's pid namespace init)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN
        children = [str(child) for child in _scan_children(pid)]
    except OSError:
        return []
    fds = []
    for child in children:
        try:
            fds.append(os.pidfd_open(int(child)))
        except OSError:
            continue  # already gone
    return fds


def _scan_children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def processes_of(uid: int) -> list[int]:
    """Pids of the processes (zombies included) whose real uid is `uid`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def await_uid_gone(uid: int, timeout_s: float) -> list[int]:
    """Kill every process of `uid` (a job's private uid) and wait until none is left, at
    most `timeout_s`; the pids still there then (none unless the host's init leaves an
    orphaned zombie unreaped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = processes_of(uid)
        if not pids or time.monotonic() >= deadline:
            return pids
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # The pid may have been reused between the scan and pidfd_open: signal
                # only a process that still has the job's uid.
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.005)
