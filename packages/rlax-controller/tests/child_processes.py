"""Helpers of the supervisor tests: small Python programs as child processes, the
supervisor's event log, and whether a process is still alive."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import textwrap


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


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
