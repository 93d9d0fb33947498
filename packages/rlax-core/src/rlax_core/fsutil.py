"""Crash-safe file writes: temp name in the same folder, fsync, rename, fsync the folder."""

from __future__ import annotations

import os
import pathlib

__all__ = ["append_line_durable", "atomic_write_bytes"]


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> pathlib.Path:
    """Replace `path` with `data` so a crash leaves either the old or the new file, never half."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def append_line_durable(path: pathlib.Path, line: str) -> None:
    """Append one line and fsync, so a record survives a SIGKILL right after it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line.rstrip("\n") + "\n")
        handle.flush()
        os.fsync(handle.fileno())
