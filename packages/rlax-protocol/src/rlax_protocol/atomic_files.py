"""Crash-safe replacement of a file: write a temporary file beside it, rename it over it.

A reader sees the old file or the new one, never half of one. With ``fsync`` (the default)
the data and then the folder entry are flushed to the disk, so the new file also survives
a crash of the machine; without it the rename alone still survives a SIGKILL of any
process (the kernel holds the data), for writers that need no more and not the fsyncs' cost.

This lives in the wire-protocol package although it has nothing to do with the wire:
every RLAX package writes files this way, and the parameter server may import no RLAX
package but this one (the layer graph in `.importlinter` and the packages' dependencies),
so the bottom of the graph is the one place every writer can import it from.

Temporary names are ``.<name>.tmp-<pid>-<random>``: hidden, unique per write (two
threads of one process may replace the same file), and recognisable, so that the owner
of a folder can remove what a killed writer left (the parameter server globs
``.weights-v*.tmp-*``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
from collections.abc import Callable, Iterator
from typing import IO

__all__ = ["atomic_write", "atomic_write_bytes", "fsync_dir", "replacing"]

StrPath = str | os.PathLike[str]


def fsync_dir(directory: StrPath) -> None:
    """Flush `directory`'s entries (a rename into it counts only once they are on the disk)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: pathlib.Path) -> None:
    # fsync flushes the file's data whichever descriptor it is called on, so the writer
    # may have written and closed the file any way it liked.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: StrPath, *, fsync: bool = True) -> Iterator[pathlib.Path]:
    """Yield a temporary path beside `path` for the caller to create and write; when the
    block ends without an exception the file there replaces `path` (fsynced first, and the
    folder after, with `fsync`). On an exception (a full disk, a crash of the writer) the
    temporary file is removed and `path` is left as it was. Creates `path`'s folder."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield tmp
        if fsync:
            _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(target.parent)


def atomic_write(
    path: StrPath, write: Callable[[IO[bytes]], object], *, fsync: bool = True, mode: int = 0o666
) -> pathlib.Path:
    """Call `write(file)` on a new binary file beside `path`, then make it `path` (see
    `replacing`). `mode`: the new file's permissions before the umask, as `open` gives
    them by default; 0o600 keeps it to its owner. Returns `path` as a `pathlib.Path`."""
    target = pathlib.Path(path)
    with replacing(target, fsync=fsync) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with open(fd, "wb") as handle:
            write(handle)
    return target


def atomic_write_bytes(
    path: StrPath, data: bytes | memoryview, *, fsync: bool = True, mode: int = 0o666
) -> pathlib.Path:
    """Replace `path` with `data` (see `atomic_write`)."""
    return atomic_write(path, lambda handle: handle.write(data), fsync=fsync, mode=mode)
