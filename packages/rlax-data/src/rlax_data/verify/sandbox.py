"""Sandboxed execution of untrusted Python programs, in parallel, judged from outside.

Each job is one process, `python -I -S -c <runner>` (`_harness.py`), started through
bubblewrap (`_isolation.py`): fresh user, pid, network, ipc, uts and mount namespaces, and
no user namespace of its own; the only files it sees are the interpreter, its standard
library and the system's shared libraries (read-only), a few device nodes, and private
`/work`, `/tmp` and `/dev/shm`, which share one tmpfs bounded in bytes and in files. `run`
returns only once every process of each job is gone (and reaped). When we run as root the
job also runs under a uid of its own, unique on the host (`UidPool`), and its processes
count against the per-job process limit. The runner sets resource limits (CPU seconds,
address space, file size, open files, processes) before any program code runs.

The verdict is decided here, never in the job: the job receives only the program and
the *arguments* of each test call, and sends back each return value as plain JSON
(`plain_values`: built-in types only, no subclasses). This process compares them with
the expected values, which never enter the sandbox, and a case without a reply (the
program exited, crashed or timed out first) fails. Assert-style test scripts (HumanEval's
`check(candidate)`) run in a second sandbox that holds no program (`_run_script`): the
entry point there is a stand-in whose calls this process relays to the program's
sandbox, as plain values both ways; that sandbox reports whether the script finished.

`SandboxConfig.isolation="process"` runs jobs without bubblewrap (resource limits and a
private session only); it is never chosen implicitly, and the sandbox logs a warning.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rlax_data.verify import _channel, _isolation
from rlax_data.verify._process import JobProcess, await_uid_gone, processes_of
from rlax_data.verify.plain_values import from_plain, to_plain
from rlax_data.verify.sandbox_jobs import CaseOutcome, ExecJob, JobResult, SandboxConfig
from rlax_data.verify.verdicts import compare_reply, exit_reason, io_outcome, limit_label

__all__ = ["CaseOutcome", "ExecJob", "JobResult", "Sandbox", "SandboxConfig", "bwrap_available"]

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# The runner's source: the shared plain-value encoding, then the runner itself.
_RUNNER = (_HERE / "plain_values.py").read_text() + "\n" + (_HERE / "_harness.py").read_text()


def bwrap_available() -> bool:
    """Whether bubblewrap is installed (whether it works here is `Sandbox.self_check`'s job)."""
    return shutil.which("bwrap") is not None


class Sandbox:
    """Runs `ExecJob`s in isolated subprocesses, `workers` at a time."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = c = config or SandboxConfig()
        self._workers = c.workers or os.cpu_count() or 1
        self._private_uid = c.isolation == "bwrap" and os.geteuid() == 0
        self._uids = _isolation.UidPool(c.uid_base, c.uid_count) if self._private_uid else None
        if c.isolation == "bwrap":
            if not bwrap_available():
                raise RuntimeError(_isolation.BWRAP_MISSING)
            _isolation.check_bwrap()
            self._interp = _isolation.find_interpreter(c.python, self._private_uid)
            python = self._interp.executable
            self.isolation: dict[str, Any] = {
                "mode": "bwrap",
                "network": "bwrap netns",
                "filesystem": "interpreter and stdlib read-only, /work, /tmp, /dev/shm on one bounded tmpfs",
                "user": "private uid per job"
                if self._private_uid
                else "caller's uid in a per-job user namespace",
            }
        else:
            python = os.path.realpath(c.python or sys.executable)
            self.isolation = {
                "mode": "process",
                "network": "none",
                "filesystem": "none (host filesystem visible)",
                "user": "caller's uid",
            }
            log.warning(
                "sandbox.isolation='process': programs run with resource limits only, without "
                "filesystem, network or process isolation; use it only for trusted programs"
            )
        self.isolation.update(workers=self._workers, python=python)
        self._python = python
        self._checked = False

    def self_check(self) -> None:
        """Run a trivial program once; raise if this host cannot run one (no user
        namespaces, say), instead of failing every program later."""
        job = ExecJob(mode="tests", program="def f(x):\n    return 2 * x\n", entry_point="f",
                      calls=[{"args": [21], "kwargs": {}, "expected": 42}])  # fmt: skip
        res = self._execute(job)
        if not res.passed:
            raise RuntimeError(
                f"the sandbox cannot run a trivial program here ({self.isolation}): status {res.status} "
                f"({res.reason}), cases {res.cases}, stderr: {res.stderr.strip()[-1000:]}. With bubblewrap "
                "this usually means the host refuses user namespaces; sandbox.isolation='process' runs "
                "without them (limits only: trusted programs only)"
            )
        self._checked = True

    def run(self, jobs: Sequence[ExecJob]) -> list[JobResult]:
        """Run `jobs` in parallel (bounded by `workers`); results in job order."""
        if not jobs:
            return []
        if not self._checked:
            self.self_check()
        if len(jobs) == 1 or self._workers == 1:
            return [self._execute(j) for j in jobs]
        with ThreadPoolExecutor(max_workers=min(self._workers, len(jobs))) as pool:
            return list(pool.map(self._execute, jobs))

    def _limits(self) -> dict[str, int]:
        c = self.config
        if c.isolation == "bwrap":
            # Counted per job (its own user namespace): the program's processes and
            # threads, plus bubblewrap's init and the runner's supervisor.
            nproc = c.max_procs + 2
        else:
            # RLIMIT_NPROC counts every process of the caller's uid: a rough cap at best.
            nproc = len(processes_of(os.getuid())) + c.max_procs
        return {
            "cpu_s": c.cpu_s,
            "as_bytes": c.memory_mb << 20,
            "fsize_bytes": c.file_size_mb << 20,
            "nofile": c.max_open_files,
            "nproc": nproc,
        }

    def _execute(self, job: ExecJob) -> JobResult:
        with ExitStack() as stack:
            # The program and the tests (if a script) run in two sandboxes, as two uids.
            n_uids = 2 if job.mode == "tests" and job.script else 1
            uids = [stack.enter_context(self._uids.lease()) if self._uids else None for _ in range(n_uids)]
            for uid in uids:
                if uid is not None:
                    # Runs after the jobs are closed, before their uids go back to the pool.
                    stack.callback(_release_check, uid)
            t0 = time.monotonic()
            timeout = job.timeout_s or self.config.timeout_s
            program = self._start(uids[0], job.stdin.encode(), t0 + timeout)
            stack.callback(program.close)
            tests = None
            if n_uids == 2:
                tests = self._start(uids[1], b"", t0 + timeout)
                stack.callback(tests.close)
            return self._judge(job, program, tests, t0, timeout)
        raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow

    def _start(self, uid: int | None, stdin: bytes, deadline: float) -> JobProcess:
        c = self.config

        def harness(request_fd: int, reply_fd: int, status_fd: int) -> list[str]:
            return ["-c", _RUNNER, str(request_fd), str(reply_fd), str(status_fd)]

        if c.isolation == "bwrap":
            scratch = _isolation.scratch_spec(c.tmpfs_mb << 20, c.tmpfs_files)
            return JobProcess(
                lambda *fds: _isolation.bwrap_command(self._interp, [*harness(*fds), scratch]),
                uid=uid, stdin=stdin, deadline=deadline, max_bytes=c.max_output_bytes,
                env={"PATH": "/usr/bin:/bin"}, cwd="/", pid_namespace=True,
            )  # fmt: skip
        workdir = tempfile.mkdtemp(prefix="rlax-sandbox-")
        return JobProcess(
            lambda *fds: [self._python, "-I", "-S", *harness(*fds)],
            uid=uid, stdin=stdin, deadline=deadline, max_bytes=c.max_output_bytes,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
            cwd=workdir, workdir=workdir,
        )  # fmt: skip

    def _judge(
        self, job: ExecJob, program: JobProcess, tests: JobProcess | None, t0: float, timeout: float
    ) -> JobResult:
        chan = program.chan
        spec = {
            "mode": job.mode,
            "program": job.program,
            "entry_point": job.entry_point,
            "limits": self._limits(),
        }
        outcomes: list[CaseOutcome | None] = [None] * (
            0 if job.mode == "run" else 1 if job.mode == "io" else len(_case_ids(job))
        )
        try:
            chan.send(spec)
            if job.mode in ("io", "run"):
                _await_exit(chan)
            else:
                self._run_tests(job, chan, tests, outcomes)
        except _channel.Stopped:
            pass  # the cases without an outcome fail below, with the reason
        ended = program.stop()
        elapsed = time.monotonic() - t0
        stdout, stderr = ended.stdout, ended.stderr
        if chan.timed_out:
            status = "timeout"
            reason = f"timed out after {timeout:g}s (wall-clock time limit); all its processes were killed"
        elif job.mode == "tests" and all(o is not None for o in outcomes):
            status, reason = "ok", ""  # every case was answered: how it ended later is moot
        elif ended.program is not None:
            status, reason = exit_reason(ended.program[0], ended.program[1], stderr, self.config)
        elif ended.by_itself:
            status = "crashed"
            reason = (
                f"the job's supervisor ended (status {ended.returncode}) without saying how the program did"
            )
        elif chan.stopped:
            status, reason = "crashed", f"the job sent {chan.stopped}"
        else:
            status, reason = "ok", ""
        if job.mode == "run":
            cases = []
        elif job.mode == "io":
            cases = [io_outcome(job, status, reason, stdout)]
        else:
            why = reason or "no reply"
            if status == "ok" and ended.by_itself:
                why = "the program exited before its tests had run"
            cases = [
                o or CaseOutcome(case=cid, passed=False, error=why)
                for o, cid in zip(outcomes, _case_ids(job))
            ]
        if status == "ok" and job.mode != "run":
            status = "ok" if cases and all(x.passed for x in cases) else "failed"
        return JobResult(cases=cases, status=status, returncode=ended.returncode, stdout=stdout,
                         stderr=stderr[-4000:], elapsed_s=elapsed, reason=reason)  # fmt: skip

    def _run_tests(
        self,
        job: ExecJob,
        chan: _channel.Channel,
        tests: JobProcess | None,
        outcomes: list[CaseOutcome | None],
    ) -> None:
        """Fill `outcomes` (script first, then the calls) until the job stops answering."""
        loaded = chan.recv()
        if loaded.get("loaded") is not True:
            error = (
                "program failed: " + str(loaded.get("error", ""))[-2000:] + limit_label(loaded, self.config)
            )
            outcomes[:] = [CaseOutcome(case=cid, passed=False, error=error) for cid in _case_ids(job)]
            return
        first = 0
        if tests is not None:
            outcomes[0] = self._run_script(job, chan, tests)
            first = 1
        for k, call in enumerate(job.calls):
            reply = chan.call(call.get("args", []), call.get("kwargs", {}))
            outcomes[first + k] = compare_reply(k, call.get("expected"), reply, self.config)

    def _run_script(self, job: ExecJob, program: _channel.Channel, tests: JobProcess) -> CaseOutcome:
        """Run the test script in its own sandbox, relaying each call of the entry point
        to the program's sandbox: plain values in, plain values out. `Stopped` from the
        program's channel propagates (its tests did not finish)."""
        spec = {
            "mode": "judge",
            "prelude": job.prelude,
            "script": job.script,
            "entry_point": job.entry_point,
            "seed": zlib.crc32(job.script.encode()),
            "limits": self._limits(),
        }
        try:
            tests.chan.send(spec)
            while True:
                msg = tests.chan.recv()
                call = msg.get("call")
                if call is None:
                    break
                try:
                    args, kwargs = from_plain(call["args"]), from_plain(call["kwargs"])
                    if type(args) is not list or type(kwargs) is not dict:
                        raise ValueError("args must be a list and kwargs a dict")
                except (ValueError, TypeError, KeyError, RecursionError) as e:
                    return CaseOutcome(
                        case="script", passed=False, error=f"the tests sent a malformed call: {e}"
                    )
                reply = program.call(args, kwargs)
                if "value" in reply:
                    tests.chan.send({"value": to_plain(reply["value"])})
                else:
                    tests.chan.send({"error": str(reply["error"]), "type": str(reply.get("type"))})
        except _channel.Stopped:
            if program.stopped:
                raise
            ended = tests.stop()
            why = "the wall-clock time limit" if tests.chan.timed_out else ""
            if ended.program is not None:
                why = exit_reason(ended.program[0], ended.program[1], ended.stderr, self.config)[1]
            return CaseOutcome(
                case="script", passed=False, error=f"the tests did not finish: {why or tests.chan.stopped}"
            )
        if msg.get("done") is True:
            return CaseOutcome(case="script", passed=True)
        return CaseOutcome(
            case="script", passed=False, error=str(msg.get("error", "the tests failed"))[-2000:]
        )


def _release_check(uid: int) -> None:
    """A private uid goes back to the pool only with no process left: stopping a job
    already waited for its pid namespace to empty; this kills and waits for anything of
    the uid that is still there (a job whose stopping went wrong)."""
    left = await_uid_gone(uid, timeout_s=2.0)
    if left:
        log.error("sandbox uid %d still has processes %s after its job was stopped", uid, left)


def _case_ids(job: ExecJob) -> list[str | int]:
    return (["script"] if job.script else []) + list(range(len(job.calls)))


def _await_exit(chan: _channel.Channel) -> None:
    """Wait until the job's main process exits (the deadline raises `Stopped`)."""
    while True:
        left = chan.deadline - time.monotonic()
        if left <= 0 or not select.select([chan.pidfd], [], [], left)[0]:
            if time.monotonic() >= chan.deadline:
                chan.timed_out = True
                raise _channel.Stopped("deadline")
            continue
        return
