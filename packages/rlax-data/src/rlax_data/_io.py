"""Atomic file writes: temp name in the same folder, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgspec


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> Path:
    """Call `write(fileobj)` on a temp file beside `path`, fsync it, then rename it onto `path`.

    A reader never sees a half-written file; a crash leaves the old file (or none) in place.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename itself is durable only once the directory entry is synced.
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write `obj` (anything msgspec can encode) as indented JSON, atomically."""
    return atomic_write_bytes(path, msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))
