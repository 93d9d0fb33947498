"""A process's memory as Linux reports it in /proc, in MiB (tests and benchmarks use it).

`status` fields: VmRSS (resident now), VmHWM (peak resident), RssAnon / RssFile (resident
anonymous / file-backed pages). `smaps_rollup` fields: Pss (proportional set size: a page
mapped by n processes counts 1/n in each), Pss_Anon, Pss_File.
"""

from __future__ import annotations

import pathlib

__all__ = ["memory_mb"]

_ROLLUP_FIELDS = frozenset({"Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Rss", "Anonymous"})
_STATUS_FIELDS = frozenset({"VmRSS", "VmHWM", "VmSize", "VmPeak", "RssAnon", "RssFile", "RssShmem"})


def memory_mb(pid: int | str = "self", field: str = "VmRSS") -> float | None:
    """`field` of process `pid` in MiB; None once the process is gone or exiting (a zombie's
    status has no memory fields), or on another OS.

    Raises `ValueError` for a field this reader does not know (a typo must not read as 0)."""
    if field not in _ROLLUP_FIELDS | _STATUS_FIELDS:
        raise ValueError(
            f"unknown /proc memory field {field!r} (known: {sorted(_ROLLUP_FIELDS | _STATUS_FIELDS)})"
        )
    name = "smaps_rollup" if field in _ROLLUP_FIELDS else "status"
    try:
        text = pathlib.Path(f"/proc/{pid}/{name}").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return None
