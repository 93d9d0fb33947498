"""Helpers of the supervisor tests: small Python programs as child processes, the
supervisor's event log, and whether a process is still alive."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import textwrap
import time


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def completes_when(log_dir: pathlib.Path, condition: str, *, timeout_s: float = 120.0) -> list[str]:
    """A program that exits 0 once `condition` (a Python expression over `events`, the
    supervisor's event log so far as a list of dicts) holds: a run's completing process that
    waits for the state a test needs instead of sleeping for a while. After `timeout_s` (a
    bound on a hang, no duration the test relies on) it exits 0 anyway, so that a broken
    supervisor fails the test's own checks instead of hanging it."""
    return py(
        f"""
        import json, pathlib, time
        log = pathlib.Path({str(log_dir)!r}) / "events.jsonl"
        deadline = time.monotonic() + {timeout_s!r}
        def holds():
            text = log.read_text() if log.exists() else ""
            events = [json.loads(line) for line in text.split("\\n")[:-1]]  # whole lines only
            return {condition}
        while not holds() and time.monotonic() < deadline:
            time.sleep(0.02)
        """
    )


def restarted_after_chaos(role: str, starts: pathlib.Path) -> str:
    """A `completes_when` condition: chaos killed a process of `role`, and the supervisor
    started it again and that new life is up (it touched `starts/<pid>`)."""
    return (
        f"any(e['event'] == 'chaos_kill' and e['role'] == {role!r} and any("
        f"s['event'] == 'start' and s['name'] == e['name'] and pathlib.Path({str(starts)!r}, str(s['pid'])).exists()"
        f" for s in events[i + 1:]) for i, e in enumerate(events))"
    )


def events(log_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "events.jsonl").read_text().splitlines()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); it is dead for our purpose
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def survivors(pids: list[int], *, timeout_s: float = 30.0) -> list[int]:
    """The processes of `pids` still alive once they all died or `timeout_s` passed (a dead
    process may take a moment to be reaped; the deadline only bounds that wait). Survivors
    are SIGKILLed so that none outlives the test."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left
