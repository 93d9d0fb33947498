"""Crash-safe file writes: a temp name in the same folder, fsync, then rename."""

from __future__ import annotations

import os
import pathlib
import tempfile


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
