"""The sandbox's verdicts, decided outside the job: a call case's reply against its
expected value, an "io" job's output, and what a job's exit (or an exception it reported)
says about the limit it hit."""

from __future__ import annotations

import errno
import signal
from typing import Any

from rlax_data.verify.sandbox_jobs import CaseOutcome, ExecJob, SandboxConfig


def normalise_stdout(text: str) -> str:
    """`text` without leading and trailing blank lines or trailing whitespace on a line."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def json_view(value: Any) -> Any:
    """Tuples as lists (expected values of call cases come from JSON)."""
    if type(value) is tuple or type(value) is list:
        return [json_view(v) for v in value]
    if type(value) is dict:
        return {k: json_view(v) for k, v in value.items()}
    return value


def compare_reply(case: int, expected: Any, reply: dict[str, Any], config: SandboxConfig) -> CaseOutcome:
    """The outcome of call case `case`: the job's `reply` (a value, or the exception it raised) against `expected`."""
    if "value" not in reply:
        return CaseOutcome(
            case=case, passed=False, error=str(reply["error"])[-2000:] + limit_label(reply, config)
        )
    got = json_view(reply["value"])
    try:
        ok = got == expected  # both are built-in values: no code of the program runs here
    except RecursionError:
        ok = False
    error = "" if ok else f"expected {expected!r:.300}, got {got!r:.300}"
    return CaseOutcome(case=case, passed=ok, error=error)


def io_outcome(job: ExecJob, status: str, reason: str, stdout: str) -> CaseOutcome:
    """The outcome of an "io" job that ended with `status` and wrote `stdout`."""
    if status != "ok":
        return CaseOutcome(case="io", passed=False, error=reason)
    want, got = normalise_stdout(job.expected_stdout or ""), normalise_stdout(stdout)
    if got == want:
        return CaseOutcome(case="io", passed=True)
    return CaseOutcome(
        case="io", passed=False, error=f"stdout mismatch: expected {want[:200]!r}, got {got[:200]!r}"
    )


def limit_label(failure: dict[str, Any], config: SandboxConfig) -> str:
    """Which limit an exception the program reported stands for, if any."""
    c = config
    kind, code = failure.get("type"), failure.get("errno")
    if kind == "MemoryError":
        return f" (memory limit {c.memory_mb} MB)"
    if code == errno.EFBIG:
        return f" (file size limit {c.file_size_mb} MB)"
    if code == errno.EAGAIN and kind == "BlockingIOError":
        return f" (process limit {c.max_procs})"
    if code == errno.EMFILE:
        return f" (open files limit {c.max_open_files})"
    if code == errno.ENOSPC and c.isolation == "bwrap":
        return (
            f" (the job's files limit: {c.tmpfs_mb} MB and {c.tmpfs_files} files in all of "
            "/work, /tmp and /dev/shm)"
        )
    return ""


def exit_reason(rc: int, cpu_used: float, stderr: str, config: SandboxConfig) -> tuple[str, str]:
    """Status and reason for a job that ended by itself with exit status `rc`."""
    c = config
    sig = -rc if rc < 0 else None
    if sig is None:
        if rc == 0:
            return "ok", ""
        last = stderr.strip().splitlines()[-1:] or [""]
        kind = last[0].split(":", 1)[0]
        code = next((n for n in (errno.EFBIG, errno.EAGAIN, errno.ENOSPC) if f"[Errno {n}]" in last[0]), None)
        label = limit_label({"type": kind, "errno": code}, config)
        return "crashed", f"exit status {rc}: {last[0][-300:]}{label}"
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= c.cpu_s - 0.05):
        return "killed", f"CPU time limit ({c.cpu_s} s; used {cpu_used:.1f} s), {name}"
    if sig == signal.SIGXFSZ:
        return "killed", f"file size limit ({c.file_size_mb} MB), {name}"
    if sig == signal.SIGKILL:
        return "killed", (
            f"SIGKILL that no limit of the job explains (used {cpu_used:.1f} s of {c.cpu_s} s CPU): sent "
            "from outside the sandbox (the host's OOM killer, another process) or by the program itself"
        )
    return "crashed", f"killed by {name}"
