"""Crash-safe file replacement: whole or absent, temporary names an owner can find, fsync on request."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
from typing import IO

import pytest

from rlax_protocol import atomic_files
from rlax_protocol.atomic_files import atomic_write, atomic_write_bytes, replacing


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_into_a_new_folder_and_leaves_no_temporary_file(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "a" / "b" / "out.json"
    got = atomic_write_bytes(str(target), b"{}\n")
    assert got == target and isinstance(got, pathlib.Path)
    assert target.read_bytes() == b"{}\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_the_old_file_stays_until_the_new_one_is_complete(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    seen: list[str] = []

    def write(handle: IO[bytes]) -> None:
        handle.write(b"new, first half")
        # While the writer runs, readers of `target` see the old bytes, and the temporary
        # file has the name an owner's cleanup looks for.
        assert target.read_bytes() == b"old"
        seen.extend(p.name for p in tmp_path.iterdir() if p.name != "state.bin")
        handle.write(b", second half")

    atomic_write(target, write)
    assert target.read_bytes() == b"new, first half, second half"
    assert len(seen) == 1 and seen[0].startswith(f".state.bin.tmp-{os.getpid()}-"), seen
    assert list(tmp_path.glob(".state.bin.tmp-*")) == []


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(
    tmp_path: pathlib.Path, failure: BaseException
) -> None:
    target = tmp_path / "report.json"
    target.write_bytes(b"old")

    def write(handle: IO[bytes]) -> None:
        handle.write(b"partial")
        raise failure

    with pytest.raises(type(failure)):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_replacing_takes_a_file_written_by_path(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100_000)
    with replacing(tmp_path / "copy" / "source.bin") as tmp:
        assert tmp.parent == tmp_path / "copy" and not tmp.exists()
        shutil.copyfile(source, tmp)
    assert (tmp_path / "copy" / "source.bin").read_bytes() == source.read_bytes()
    with pytest.raises(RuntimeError), replacing(tmp_path / "copy" / "source.bin") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the copy failed")
    assert (tmp_path / "copy" / "source.bin").read_bytes() == source.read_bytes()
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["source.bin"]


def test_each_write_gets_its_own_temporary_name(tmp_path: pathlib.Path) -> None:
    """Two writers of one file in one process (threads) must not share a temporary file."""
    target = tmp_path / "shared.txt"
    with replacing(target) as first, replacing(target) as second:
        assert first != second
        first.write_bytes(b"1")
        second.write_bytes(b"2")
    assert target.read_bytes() == b"1"  # the outer block ends last: its file wins


def test_permissions_default_to_opens_and_can_be_kept_private(tmp_path: pathlib.Path) -> None:
    umask = os.umask(0o022)
    try:
        shared = atomic_write_bytes(tmp_path / "shared", b"x")
        private = atomic_write_bytes(tmp_path / "private", b"x", mode=0o600)
        with open(tmp_path / "by-open", "wb") as handle:
            handle.write(b"x")
    finally:
        os.umask(umask)
    assert _mode(shared) == _mode(tmp_path / "by-open") == 0o644
    assert _mode(private) == 0o600


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_flushes_the_file_and_then_its_folder_only_when_asked(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(atomic_files.os, "fsync", recording_fsync)
    atomic_write_bytes(tmp_path / "out", b"data", fsync=fsync)
    assert synced == (["file", "folder"] if fsync else [])
    assert (tmp_path / "out").read_bytes() == b"data"
