"""What the sandbox runs and what it answers: its limits (`SandboxConfig`), a job
(`ExecJob`) and a job's result (`JobResult`, one `CaseOutcome` per test case)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class SandboxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits and isolation of one sandboxed run.

    timeout_s: wall-clock limit per job. cpu_s: RLIMIT_CPU (whole seconds).
    memory_mb: RLIMIT_AS. file_size_mb: RLIMIT_FSIZE. max_procs: processes and threads
    the program may have, itself included. tmpfs_mb: what the job's files may take in all,
    in `/work`, `/tmp` and `/dev/shm` together (shared memory is host memory: it counts
    here like any file). tmpfs_files: files and folders they may hold in all (each costs
    kernel memory).
    isolation: "bwrap" (required unless "process" is chosen explicitly: limits only).
    uid_base/uid_count: the host-wide pool of private uids (used when running as root).
    python: interpreter for the jobs ("" = this one, or a system one of the same version
    when a private uid cannot read this one). workers: parallel jobs (0 = CPU count).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_open_files: int = 64
    max_procs: int = 4
    tmpfs_mb: int = 64
    tmpfs_files: int = 4096
    isolation: Literal["bwrap", "process"] = "bwrap"
    uid_base: int = 61000
    uid_count: int = 4096
    workers: int = 0
    python: str = ""
    max_output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in (
            "timeout_s",
            "cpu_s",
            "memory_mb",
            "file_size_mb",
            "max_open_files",
            "max_procs",
            "tmpfs_mb",
            "tmpfs_files",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"field `sandbox.{name}`: must be > 0, got {value!r}")
        if self.workers < 0:
            raise ValueError(f"field `sandbox.workers`: must be >= 0 (0 = CPU count), got {self.workers}")
        if not (1000 <= self.uid_base and self.uid_count > 0 and self.uid_base + self.uid_count < 2**31):
            raise ValueError(
                "field `sandbox.uid_base`: [uid_base, uid_base + uid_count) must lie in [1000, 2**31)"
            )


class CaseOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One test case: `case` is "script", a call index, or "io"."""

    case: str | int
    passed: bool
    error: str = ""


class ExecJob(msgspec.Struct, frozen=True, kw_only=True):
    """One process to run.

    mode "tests": run `program`, then the `script` (if any; run outside the sandbox after
    `prelude`, with `entry_point` forwarded to the job) and each `calls` case
    ({"args", "kwargs", "expected"}; only the arguments reach the job).
    mode "io": run `program` with `stdin`; it passes if it exits with status 0 and its
    stdout equals `expected_stdout` (trailing whitespace of each line ignored).
    mode "run": run `program` with `stdin` and judge nothing: the result has no cases,
    its status says how the program ended (ok: exit status 0) and `stdout` / `stderr`
    hold what it wrote (for tools that show a program's output, not tests).
    """

    mode: Literal["tests", "io", "run"]
    program: str
    script: str = ""
    prelude: str = ""
    entry_point: str | None = None
    calls: list[dict[str, Any]] = []
    stdin: str = ""
    expected_stdout: str | None = None
    timeout_s: float | None = None


class JobResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one job did. status: ok | failed | timeout | killed | crashed ("run" jobs
    have no cases and are never "failed").
    `reason` says why the process ended early (which limit, or a signal from outside)."""

    cases: list[CaseOutcome]
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    reason: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)
