"""Sandboxed execution of untrusted Python programs, in parallel.

Each job runs `python -I -S _harness.py` in a subprocess:
- resource limits (CPU seconds, address space, file size, open files, process count),
  set by the harness with `resource` before any user code runs (not in a `preexec_fn`:
  that is unsafe with the thread pool that runs jobs in parallel);
- when the host runs us as root, a private uid per pool slot, so the process-count limit
  caps that slot alone, the program cannot write anywhere but its own temporary
  directory, and every leftover process of the slot can be found and killed;
- no network: a fresh network namespace (`unshare --net`, no interfaces but a downed
  loopback) when it can be made, plus an in-process audit hook that refuses sockets,
  process creation, ctypes and writes outside the temporary directory;
- a private temporary directory as cwd, HOME and TMPDIR, removed afterwards;
- its own session: at the timeout (and after any exit) the whole process group is killed.

`Sandbox.isolation` says which of these the host allowed; `SandboxConfig.network`
chooses between the namespace and the hook alone, and requiring a namespace the host
cannot make is an error rather than a silent downgrade.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = ["CaseOutcome", "ExecJob", "JobResult", "Sandbox", "SandboxConfig", "netns_available"]

_HARNESS = Path(__file__).with_name("_harness.py")

# Imported before privileges drop: the interpreter's own files may be unreadable to the
# sandbox uid (a pyenv under /root), so modules user code may want must already be loaded.
DEFAULT_PRELOAD = (
    "math", "cmath", "re", "string", "collections", "collections.abc", "itertools", "functools",
    "operator", "typing", "heapq", "bisect", "hashlib", "random", "statistics", "fractions",
    "decimal", "json", "copy", "datetime", "array", "struct", "dataclasses", "enum", "numbers",
    "textwrap", "unicodedata", "io", "time", "traceback", "linecache", "contextlib", "queue",
    "base64", "binascii", "zlib", "calendar", "difflib", "pprint", "threading", "warnings", "weakref",
    "ast", "secrets", "uuid", "glob", "fnmatch", "shlex", "csv",
)  # fmt: skip


class SandboxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits and isolation of one sandboxed run.

    timeout_s: wall-clock limit per job; the process group is killed then.
    cpu_s: RLIMIT_CPU (whole seconds). memory_mb: RLIMIT_AS. file_size_mb: RLIMIT_FSIZE.
    max_procs: RLIMIT_NPROC of the slot uid (1 means no child process at all).
    network: "auto" (namespace if the host allows, else hook only), "netns" (required),
    "audit" (hook only). workers: parallel jobs. uid_base: first private uid (root only).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_open_files: int = 64
    max_procs: int = 4
    network: Literal["auto", "netns", "audit"] = "auto"
    drop_privileges: bool = True
    uid_base: int = 61000
    workers: int = 0
    python: str = ""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    max_output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "max_open_files", "max_procs"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"field `sandbox.{name}`: must be > 0, got {value!r}")
        if self.workers < 0:
            raise ValueError(f"field `sandbox.workers`: must be >= 0 (0 = CPU count), got {self.workers}")
        if not 1000 <= self.uid_base < 2**31 - 1024:
            raise ValueError(f"field `sandbox.uid_base`: must be in [1000, 2**31-1024), got {self.uid_base}")


class CaseOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One test case: `case` is "script", a call index, or "io"."""

    case: str | int
    passed: bool
    error: str = ""


class ExecJob(msgspec.Struct, frozen=True, kw_only=True):
    """One process to run.

    mode "tests": run `program`, then `script` (if any) and each `calls` case;
    mode "io": run `program` with `stdin`; passing also needs stdout == `expected_stdout`.
    """

    mode: Literal["tests", "io"]
    program: str
    script: str = ""
    entry_point: str | None = None
    calls: list[dict[str, Any]] = []
    stdin: str = ""
    expected_stdout: str | None = None
    timeout_s: float | None = None


class JobResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one job did. status: ok | failed | timeout | killed | crashed."""

    cases: list[CaseOutcome]
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)


_netns_cache: dict[str, bool] = {}


def netns_available() -> bool:
    """Whether `unshare --net` works here (root, or a kernel allowing it); probed once."""
    if "ok" not in _netns_cache:
        exe = shutil.which("unshare")
        ok = False
        if exe is not None:
            try:
                ok = subprocess.run([exe, "--net", "true"], capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
        _netns_cache["ok"] = ok
    return _netns_cache["ok"]


def _normalise_stdout(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


class Sandbox:
    """Runs `ExecJob`s in isolated subprocesses, `workers` at a time."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        c = self.config
        self._python = c.python or sys.executable
        self._privileged = c.drop_privileges and os.geteuid() == 0
        if c.network == "netns" and not netns_available():
            raise RuntimeError("sandbox.network='netns' but `unshare --net` fails on this host (needs root)")
        self._netns = c.network == "netns" or (c.network == "auto" and netns_available())
        self._workers = c.workers or os.cpu_count() or 1
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self._workers):
            self._slots.put(i)
        self._checked = False
        self.isolation = {
            "network": "netns+audit-hook" if self._netns else "audit-hook",
            "user": f"private uid per slot from {c.uid_base}"
            if self._privileged
            else "same uid as the caller",
            "workers": self._workers,
        }

    def self_check(self) -> None:
        """Run a trivial program once; raise if the sandbox itself cannot start one on this
        host (say the uid switch is refused), instead of failing every program later."""
        res = self._run_one(ExecJob(mode="tests", program="x = 1", script="assert x == 1"))
        if not res.passed:
            raise RuntimeError(
                f"sandbox cannot run a trivial program here ({self.isolation}): status {res.status}, "
                f"returncode {res.returncode}, stderr: {res.stderr.strip()[-1000:]}"
            )
        self._checked = True

    def run(self, jobs: Sequence[ExecJob]) -> list[JobResult]:
        """Run `jobs` in parallel (bounded by `workers`); results in job order."""
        if not jobs:
            return []
        if not self._checked:
            self.self_check()
        if len(jobs) == 1 or self._workers == 1:
            return [self._run_one(j) for j in jobs]
        with ThreadPoolExecutor(max_workers=min(self._workers, len(jobs))) as pool:
            return list(pool.map(self._run_one, jobs))

    def _run_one(self, job: ExecJob) -> JobResult:
        slot = self._slots.get()
        try:
            return self._execute(job, slot)
        finally:
            self._slots.put(slot)

    def _execute(self, job: ExecJob, slot: int) -> JobResult:
        c = self.config
        uid = c.uid_base + slot if self._privileged else None
        workdir = Path(tempfile.mkdtemp(prefix="rlax-sandbox-"))
        read_fd = write_fd = -1
        proc: subprocess.Popen[bytes] | None = None
        t0 = time.monotonic()
        try:
            # Traversable but not listable: the slot uid reaches only its own `work` folder.
            os.chmod(workdir, 0o711)
            sandbox_dir = workdir / "work"
            sandbox_dir.mkdir(mode=0o700)
            if uid is not None:
                os.chown(sandbox_dir, uid, uid)
            nonce = secrets.token_hex(16)
            case_ids: list[str | int] = []
            if job.mode == "tests":
                case_ids = (["script"] if job.script else []) + list(range(len(job.calls)))
            spec = {
                "mode": "io" if job.mode == "io" else "tests",
                "program": job.program,
                "script": job.script,
                "entry_point": job.entry_point,
                "calls": job.calls,
                "cases": case_ids,
                "nonce": nonce,
                "sandbox_dir": str(sandbox_dir),
                "uid": uid,
                "gid": uid,
                "block_network": True,
                "preload": list(c.preload),
                "limits": {
                    "cpu_s": c.cpu_s,
                    "as_bytes": c.memory_mb << 20,
                    "fsize_bytes": c.file_size_mb << 20,
                    "nofile": c.max_open_files,
                    "nproc": c.max_procs if uid is not None else _own_process_count() + c.max_procs,
                },
            }
            spec_path = workdir / "spec.json"
            # Read by the harness before it drops privileges; unreadable to the slot uid.
            fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(spec))
            read_fd, write_fd = os.pipe()
            cmd = [self._python, "-I", "-S", str(_HARNESS), str(spec_path), str(write_fd)]
            if self._netns:
                cmd = [shutil.which("unshare") or "unshare", "--net", "--", *cmd]
            env = {
                "PATH": "/usr/bin:/bin",
                "HOME": str(sandbox_dir),
                "TMPDIR": str(sandbox_dir),
                "LANG": "C.UTF-8",
            }
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd,),
                cwd=str(sandbox_dir),
                env=env,
                start_new_session=True,
            )
            os.close(write_fd)
            write_fd = -1
            timeout = job.timeout_s or c.timeout_s
            outs, timed_out = self._pump(proc, job.stdin.encode(), read_fd, t0 + timeout, uid)
            rc = proc.returncode
            elapsed = time.monotonic() - t0
            stdout = outs[0].decode("utf-8", "replace")
            stderr = outs[1].decode("utf-8", "replace")
            cases = _parse_results(outs[2], nonce)
            return self._judge(job, case_ids, cases, rc, timed_out, stdout, stderr, elapsed)
        finally:
            if proc is not None and proc.poll() is None:
                self._kill_all(proc, uid)
                proc.wait()
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)

    def _pump(
        self, proc: subprocess.Popen[bytes], stdin: bytes, result_fd: int, deadline: float, uid: int | None
    ) -> tuple[list[bytes], bool]:
        """Feed stdin and collect stdout, stderr and the result pipe until EOF or the deadline."""
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        cap = self.config.max_output_bytes
        bufs = [bytearray(), bytearray(), bytearray()]
        sel = selectors.DefaultSelector()
        for i, f in enumerate((proc.stdout.fileno(), proc.stderr.fileno(), result_fd)):
            os.set_blocking(f, False)
            sel.register(f, selectors.EVENT_READ, i)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, -1)
        else:
            proc.stdin.close()
        open_readers = 3
        timed_out = False
        reaped = False
        try:
            while open_readers:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = proc.poll() is None
                    break
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    if key.data == -1:
                        try:
                            n = os.write(key.fd, pending[:65536])
                            pending = pending[n:]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            pending = pending[:0]  # the program stopped reading; that is its business
                        if not pending:
                            sel.unregister(key.fd)
                            proc.stdin.close()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        open_readers -= 1
                    elif len(bufs[key.data]) < cap:
                        bufs[key.data] += chunk[: cap - len(bufs[key.data])]
                if not reaped and proc.poll() is not None:
                    # The main process is gone: anything it left behind (holding our pipes
                    # open) is killed so the remaining output reaches EOF.
                    reaped = True
                    self._kill_all(proc, uid)
        finally:
            sel.close()
        if proc.poll() is None or not reaped:
            self._kill_all(proc, uid)
        proc.wait()
        return [bytes(b) for b in bufs], timed_out

    def _kill_all(self, proc: subprocess.Popen[bytes], uid: int | None) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None:
            # A process that called setsid() left the group; the slot uid still finds it.
            for _ in range(20):
                pids = _pids_of_uid(uid)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.01)

    def _judge(
        self,
        job: ExecJob,
        case_ids: list[str | int],
        got: dict[str | int, CaseOutcome],
        rc: int | None,
        timed_out: bool,
        stdout: str,
        stderr: str,
        elapsed: float,
    ) -> JobResult:
        if timed_out:
            status, why = (
                "timeout",
                f"timed out after {job.timeout_s or self.config.timeout_s:g}s; process group killed",
            )
        elif rc is not None and rc < 0:
            sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            status, why = (
                "killed",
                f"killed by {sig}" + (" (CPU time limit)" if sig in ("SIGXCPU", "SIGKILL") else ""),
            )
        elif rc not in (0, None):
            status, why = "crashed", f"exit code {rc}: {stderr.strip()[-500:]}"
        else:
            status, why = "ok", "no result reported (the program exited early)"
        if job.mode == "io":
            res = got.get("io")
            if res is None or status != "ok":
                cases = [CaseOutcome(case="io", passed=False, error=res.error if res and res.error else why)]
            elif not res.passed:
                cases = [res]
            else:
                want = _normalise_stdout(job.expected_stdout or "")
                ok = _normalise_stdout(stdout) == want
                err = (
                    ""
                    if ok
                    else f"stdout mismatch: expected {want[:200]!r}, got {_normalise_stdout(stdout)[:200]!r}"
                )
                cases = [CaseOutcome(case="io", passed=ok, error=err)]
        else:
            cases = [got.get(cid) or CaseOutcome(case=cid, passed=False, error=why) for cid in case_ids]
            if status != "ok":
                # A result line followed by a kill (e.g. CPU limit in a later case) still counts
                # only for the cases that finished before it.
                cases = [
                    c if c.passed or c.error else CaseOutcome(case=c.case, passed=False, error=why)
                    for c in cases
                ]
        final = (
            "ok"
            if status == "ok" and all(c.passed for c in cases)
            else ("failed" if status == "ok" else status)
        )
        return JobResult(
            cases=cases, status=final, returncode=rc, stdout=stdout, stderr=stderr[-4000:], elapsed_s=elapsed
        )


def _parse_results(raw: bytes, nonce: str) -> dict[str | int, CaseOutcome]:
    out: dict[str | int, CaseOutcome] = {}
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("nonce") != nonce:
            continue
        case = obj.get("case")
        if isinstance(case, (str, int)) and case not in out:
            out[case] = CaseOutcome(
                case=case, passed=bool(obj.get("passed")), error=str(obj.get("error", ""))
            )
    return out


def _pids_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                state = b""
                for line in f:
                    if line.startswith(b"State:"):
                        state = line.split()[1]
                    elif line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid and state != b"Z":
                            pids.append(int(entry.name))
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def _own_process_count() -> int:
    return len(_pids_of_uid(os.getuid()))
