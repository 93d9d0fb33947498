"""On-disk state: the newest `keep` committed versions, one self-checking file per version.

File layout (``weights-v<version>.rlaxw``)::

    b"RLAXW\\x00\\x00\\x02"       8-byte magic
    header length              8 bytes, little-endian
    header                     msgpack `StateHeader` (manifest with checksums, metadata)
    zero padding               to a multiple of 4096
    tensor bytes               every tensor, manifest order, each starting at a multiple
                               of 64 bytes (zero padding between tensors)

Version 1 files (magic ending ``\\x01``: tensors back to back) are still read.

A loaded version is a read-only memory map of its file, not a copy: the server's memory
holds no weight bytes of its own (the kernel's page cache does, shared with every process
that maps the same file), and a worker on the same host maps the file too
(`map_state`) instead of receiving the bytes. The 64-byte alignment is what lets JAX
use a mapped tensor as a CPU array without copying it. A state file is never changed
in place (it is written under another name and renamed), so a mapping stays valid
after its file is replaced or removed.

A pusher on the same host writes a version's tensors straight into a staging file the
server created for it (`create_staging`: header written, size fixed, a name no other
push can guess); on commit the server verifies every tensor of that file, renames it
into place and serves its mapping (`install_staged`): the version crosses no socket and
no process holds an anonymous copy of it.

A server may serve from a folder in memory (a tmpfs such as /dev/shm) and keep its versions
on disk only while it is stopped (`spill_states` when it stops, `unspill_states` when it
starts): a version in memory survives a SIGKILL of any process as one in the page cache
does, without the disk's cost per push (SmolLM2's 540 MB: 1.3-1.7 s of kernel time in the
pusher's writes on this machine's ext4, 0.35 s on tmpfs).

A file is written under a temporary name, fsynced, renamed into place and the
directory fsynced, so a crash leaves either the old files or the new one too; only then
are files older than the newest `keep` removed, except the base versions those name (a
LoRA run's adapter-only versions, `rlax_protocol.lora_versions`: kept, spilled and loaded
with them). On load (up to `keep` files and their bases) every
tensor's xxh3_64 is checked against the manifest; a file that fails any check is
reported (`CorruptStateError`), renamed to ``*.corrupt`` and never served. A file that
cannot be *read* (EIO, EACCES, ...) says nothing about its bytes: it is left as it is
and loading fails with that error, rather than falling back to an older version.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pathlib
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import msgspec
import xxhash

from rlax_protocol import (
    PROTOCOL_VERSION,
    MalformedMessageError,
    ProtocolError,
    TensorManifest,
    check_msgpack_bounds,
    frame_layout,
)
from rlax_protocol.atomic_files import atomic_write, fsync_dir, replacing
from rlax_protocol.lora_versions import LoraVersionError, lora_base_of

log = logging.getLogger(__name__)

MAGIC = b"RLAXW\x00\x00\x02"
MAGIC_V1 = b"RLAXW\x00\x00\x01"  # tensors back to back (no per-tensor alignment)
ALIGN = 4096
TENSOR_ALIGN = 64  # what XLA:CPU needs to alias a host buffer instead of copying it
_NAME = re.compile(r"^weights-v(\d+)\.rlaxw$")


class CorruptStateError(ProtocolError):
    """A state file failed a check; the message names the file and what is wrong."""


class StateReadError(OSError):
    """A state file could not be read (the disk or the permissions failed, not its bytes)."""


class StateHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    protocol_version: int
    version: int
    manifest: TensorManifest
    metadata: dict[str, Any]


@dataclass
class LoadedState:
    """A mapped state file: `frames` (manifest frame order) and `tensors` (manifest
    tensor order) are read-only views of one memory map, which lives as long as they do."""

    version: int
    manifest: TensorManifest
    metadata: dict[str, Any]
    frames: list[memoryview]
    path: pathlib.Path
    tensors: list[memoryview]


def tensor_starts(manifest: TensorManifest, align: int = TENSOR_ALIGN) -> tuple[list[int], int]:
    """Each tensor's byte offset from the start of the data, and the data's total length."""
    starts: list[int] = []
    end = 0
    for tensor in manifest.tensors:
        end += (-end) % align
        starts.append(end)
        end += tensor.nbytes
    return starts, end


def state_path(state_dir: pathlib.Path, version: int) -> pathlib.Path:
    return state_dir / f"weights-v{version:012d}.rlaxw"


def _file_prefix(version: int, manifest: TensorManifest, metadata: dict[str, Any]) -> bytes:
    """Magic, header length, header and the zero padding up to the tensors' start."""
    header = msgspec.msgpack.encode(StateHeader(PROTOCOL_VERSION, version, manifest, metadata))
    prefix = MAGIC + len(header).to_bytes(8, "little") + header
    return prefix + b"\x00" * ((-len(prefix)) % ALIGN)


def _prune(state_dir: pathlib.Path, version: int, keep: int) -> None:
    """Remove state files older than `version` beyond the newest `keep` (`version` included),
    except the base versions that the kept files name (`rlax_protocol.lora_versions`)."""
    files = [(v, p) for v, p in _state_files(state_dir) if v <= version]
    kept = {v for v, _ in _newest_with_bases(files, keep)}
    for other_version, other in files:
        if other_version not in kept:
            other.unlink(missing_ok=True)


def _base_named_in(path: pathlib.Path) -> int | None:
    """The base version that the state file at `path` names, from its header alone; None for
    a full version or a file whose header cannot be read (its loader reports that)."""
    try:
        with open(path, "rb") as f:
            header, _, _ = _read_header(path, f, path.stat().st_size)
        return lora_base_of(header.metadata, header.version)
    except (OSError, CorruptStateError, LoraVersionError):
        return None


def _newest_with_bases(files: list[tuple[int, pathlib.Path]], keep: int) -> list[tuple[int, pathlib.Path]]:
    """Of `files` (version, path; oldest first), the newest `keep` and the files of the base
    versions they name, oldest first: an adapter-only version is useless without its base."""
    newest = files[-keep:]
    named = {base for _, path in newest if (base := _base_named_in(path)) is not None}
    return [(v, p) for v, p in files if (v, p) in newest or v in named]


def write_state(
    state_dir: pathlib.Path,
    version: int,
    manifest: TensorManifest,
    metadata: dict[str, Any],
    frames: Sequence[memoryview],
    *,
    keep: int = 1,
    fsync: bool = True,
) -> pathlib.Path:
    """Write one version (frames in manifest frame order) under a temporary name and rename it.

    `fsync`: flush the file and the folder to the disk before the version counts as written,
    so it survives a crash of the machine. Without it the rename alone makes the file whole
    or absent and it survives a SIGKILL of any process (the kernel holds the data), which
    is what exact resumption after killed processes needs; ~20 ms less per version on a
    laptop disk. Once the new file is written, older state files beyond the newest `keep`
    (this one included) are removed; `keep=1` leaves only this version on disk.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1 (the newest version is always kept)")
    prefix = _file_prefix(version, manifest, metadata)
    starts, _ = tensor_starts(manifest)
    slots = frame_layout(manifest)
    if len(frames) != len(slots):
        raise ValueError(f"{len(frames)} frames for a manifest of {len(slots)}")

    def write(f: IO[bytes]) -> None:
        f.write(prefix)
        written = 0
        for slot, frame in zip(slots, frames, strict=True):
            gap = starts[slot.tensor] + slot.offset - written
            if gap:
                f.write(b"\x00" * gap)
            f.write(frame)
            written += gap + slot.nbytes

    # A failed write (e.g. a full disk) leaves no half file; its temporary name is the
    # pattern an owner clears at start.
    final = atomic_write(state_path(state_dir, version), write, fsync=fsync)
    _prune(state_dir, version, keep)
    return final


@dataclass(frozen=True)
class StagingFile:
    """A file the server created for one push on its host: the pusher writes tensor `i`
    at ``data_offset + tensor_starts(manifest)[0][i]``; nothing else may change it.

    `identity`: (st_dev, st_ino) at creation, so that a file put in its place under the
    same name is never installed."""

    path: pathlib.Path
    data_offset: int
    size: int
    identity: tuple[int, int]


def create_staging(
    state_dir: pathlib.Path, version: int, manifest: TensorManifest, metadata: dict[str, Any]
) -> StagingFile:
    """Create the staging file of a push of `version`: header written, tensors' bytes zero.

    The name carries 128 random bits (a client is told it, never chooses it) and matches
    the temporary-file pattern the server clears when it starts (`load_states(owner=True)`). The file is sparse
    until written: creating it costs no disk space or time for the tensors.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    final = state_path(state_dir, version)
    path = state_dir / f".{final.name}.tmp-push-{secrets.token_hex(16)}"
    prefix = _file_prefix(version, manifest, metadata)
    _, data_bytes = tensor_starts(manifest)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, prefix)
        os.ftruncate(fd, len(prefix) + data_bytes)
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return StagingFile(path, len(prefix), len(prefix) + data_bytes, (info.st_dev, info.st_ino))


def discard_staging(staging: StagingFile) -> None:
    """Remove a staging file whose push ended without a commit (aborted, expired, corrupt)."""
    try:
        info = os.stat(staging.path, follow_symlinks=False)
    except FileNotFoundError:
        return
    if (info.st_dev, info.st_ino) == staging.identity:
        staging.path.unlink(missing_ok=True)


def install_staged(
    state_dir: pathlib.Path,
    staging: StagingFile,
    version: int,
    manifest: TensorManifest,
    *,
    keep: int = 1,
    fsync: bool = True,
) -> LoadedState:
    """Verify a staging file the pusher has written, rename it into place as `version`'s
    state file, prune older files beyond `keep`; returns the installed file's mapping.

    Every tensor is hashed against `manifest` (a pusher that died or wrote short leaves
    zeros that fail), so a version is installed only whole. Raises `CorruptStateError`
    naming the tensor, or when another file took the staging file's name.
    """
    info = os.stat(staging.path, follow_symlinks=False)
    if (info.st_dev, info.st_ino) != staging.identity or info.st_size != staging.size:
        raise CorruptStateError(
            f"{staging.path}: not the staging file created for version {version} "
            f"(replaced, or {info.st_size} bytes instead of {staging.size})"
        )
    with open(staging.path, "rb", buffering=0) as f:
        if fsync:
            os.fsync(f.fileno())
        _hash_by_reading(staging.path, f, staging.data_offset, manifest)
    # Mapped unverified, so the server's page tables never touch the pages: they stay the
    # page cache's, counted in the memory of the workers that map them, not the server's.
    loaded = map_state(staging.path, verify=False, expect=manifest)
    if loaded.version != version:
        raise CorruptStateError(f"{staging.path}: holds version {loaded.version}, not {version}")
    final = state_path(state_dir, version)
    os.replace(staging.path, final)
    if fsync:
        fsync_dir(state_dir)
    _prune(state_dir, version, keep)
    return LoadedState(loaded.version, loaded.manifest, loaded.metadata, loaded.frames, final, loaded.tensors)


_READ_BYTES = 8 << 20


def _hash_by_reading(path: pathlib.Path, f: Any, data_offset: int, manifest: TensorManifest) -> None:
    """Hash every tensor of an open state file against `manifest` by reading it through one
    small buffer (no mapping: the pages are read but never enter this process's memory)."""
    starts, _ = tensor_starts(manifest)
    buffer = memoryview(bytearray(_READ_BYTES))
    for start, tensor in zip(starts, manifest.tensors, strict=True):
        hasher = xxhash.xxh3_64()
        offset, left = data_offset + start, tensor.nbytes
        while left:
            got = os.preadv(f.fileno(), [buffer[: min(left, _READ_BYTES)]], offset)
            if got <= 0:
                raise CorruptStateError(f"{path}: ends inside tensor {tensor.name!r}")
            hasher.update(buffer[:got])
            offset, left = offset + got, left - got
        if hasher.intdigest() != tensor.checksum:
            raise CorruptStateError(
                f"{path}: tensor {tensor.name!r} fails its checksum (bytes {start}..{start + tensor.nbytes})"
            )


def write_staged(
    staging_file: str, data_offset: int, manifest: TensorManifest, frames: Sequence[Any]
) -> None:
    """The pusher's side: write a version's frames (manifest frame order, as `encode_tree`
    makes them) into a staging file the server created. Opens without creating: a path
    that does not exist here (the server is on another host) raises `FileNotFoundError`."""
    starts, data_bytes = tensor_starts(manifest)
    slots = frame_layout(manifest)
    if len(frames) != len(slots):
        raise ValueError(f"{len(frames)} frames for a manifest of {len(slots)}")
    fd = os.open(staging_file, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != data_offset + data_bytes:
            raise OSError(f"{staging_file} does not have the size of a staging file for this manifest")
        for slot, frame in zip(slots, frames, strict=True):
            view = memoryview(frame).cast("B")
            if view.nbytes != slot.nbytes:
                raise ValueError(f"frame of {view.nbytes} bytes where the manifest has {slot.nbytes}")
            offset = data_offset + starts[slot.tensor] + slot.offset
            while view.nbytes:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
    finally:
        os.close(fd)


def _read_header(path: pathlib.Path, f: Any, size: int) -> tuple[StateHeader, int, int]:
    """The header, the data's offset and the tensors' alignment (1 in a version-1 file)."""
    magic = f.read(len(MAGIC))
    if magic not in (MAGIC, MAGIC_V1):
        raise CorruptStateError(f"{path}: not an RLAX weights file (bad magic)")
    length = int.from_bytes(f.read(8), "little")
    if length <= 0 or length > size:
        raise CorruptStateError(f"{path}: header length {length} does not fit a {size}-byte file")
    raw = f.read(length)
    try:
        # Bounded first: the metadata is free-form and msgspec would recurse into it.
        check_msgpack_bounds(raw, max_bytes=length)
        header = msgspec.msgpack.decode(raw, type=StateHeader)
    except (msgspec.DecodeError, msgspec.ValidationError, MalformedMessageError) as err:
        raise CorruptStateError(f"{path}: unreadable header: {err}") from None
    if header.protocol_version != PROTOCOL_VERSION or header.manifest.protocol_version != PROTOCOL_VERSION:
        raise CorruptStateError(
            f"{path}: written with protocol version {header.protocol_version}, this server speaks {PROTOCOL_VERSION}"
        )
    offset = len(MAGIC) + 8 + length
    return header, offset + (-offset) % ALIGN, (TENSOR_ALIGN if magic == MAGIC else 1)


def read_state(path: pathlib.Path) -> LoadedState:
    """Map and fully verify one state file; raises `CorruptStateError` naming file and defect."""
    return map_state(path, verify=True)


def map_state(
    path: pathlib.Path,
    *,
    verify: bool = True,
    expect: TensorManifest | None = None,
    copy_on_write: bool = False,
) -> LoadedState:
    """Map one state file read-only; its tensors are views of the mapping, not copies.

    `verify`: hash every tensor against the manifest (reading every page once).
    `expect`: the manifest the caller was promised (e.g. by a pull's grant): a file whose
    manifest differs, checksums included, is refused as `CorruptStateError`.
    `copy_on_write`: map privately, so that a write through a view (e.g. a buffer some
    library donates) changes a private copy of the page, never the file.
    Raises `CorruptStateError` naming the file and the defect, `OSError` when it cannot be read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, data_offset, align = _read_header(path, f, size)
        if expect is not None and header.manifest != expect:
            raise CorruptStateError(f"{path}: holds another manifest than the one expected")
        starts, data_bytes = tensor_starts(header.manifest, align)
        expected = data_offset + data_bytes
        if size != expected:
            raise CorruptStateError(
                f"{path}: {size} bytes on disk, manifest needs {expected} (truncated or padded)"
            )
        if data_bytes == 0:
            view = memoryview(b"")
        else:
            access = mmap.ACCESS_COPY if copy_on_write else mmap.ACCESS_READ
            view = memoryview(mmap.mmap(f.fileno(), 0, access=access))[data_offset:]
    tensors = [
        view[start : start + t.nbytes] for start, t in zip(starts, header.manifest.tensors, strict=True)
    ]
    if verify:
        for start, tensor, data in zip(starts, header.manifest.tensors, tensors, strict=True):
            if xxhash.xxh3_64_intdigest(data) != tensor.checksum:
                raise CorruptStateError(
                    f"{path}: tensor {tensor.name!r} fails its checksum (bytes {start}..{start + tensor.nbytes})"
                )
    # Frames are slices of the mapped tensors, in frame order, so pulls need no copy.
    frames = [tensors[s.tensor][s.offset : s.offset + s.nbytes] for s in frame_layout(header.manifest)]
    return LoadedState(header.version, header.manifest, dict(header.metadata), frames, path, tensors)


def _state_files(state_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(version, path) of every state file in `state_dir`, oldest first."""
    if not state_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in state_dir.iterdir() if (m := _NAME.match(p.name)) is not None)


def _copy_state_file(source: pathlib.Path, target_dir: pathlib.Path, *, fsync: bool) -> None:
    """`source` into `target_dir` under its own name: written under a temporary name (the
    pattern an owner clears at start) and renamed, so the target is whole or absent."""
    with replacing(target_dir / source.name, fsync=fsync) as tmp:
        shutil.copyfile(source, tmp)  # by path: the kernel copies it (sendfile), no Python loop


def spill_states(
    live_dir: pathlib.Path, rest_dir: pathlib.Path, keep: int, *, fsync: bool = True
) -> list[int]:
    """A stopping server's versions, from its folder in memory to where they rest: the newest
    `keep` state files of `live_dir` are copied into `rest_dir` (a file of the same name
    and size already there is not copied again), `rest_dir`'s older state files removed,
    and only then `live_dir`'s files and the folder itself. Returns the versions copied.
    An error leaves `live_dir` as it was (it is the only complete copy)."""
    newest = _newest_with_bases(_state_files(live_dir), keep)
    for leftover in rest_dir.glob(".weights-v*.tmp-*") if rest_dir.is_dir() else ():
        leftover.unlink(missing_ok=True)  # an earlier spill cut short (this server owns rest_dir)
    for _, path in newest:
        there = rest_dir / path.name
        if not (there.exists() and there.stat().st_size == path.stat().st_size):
            _copy_state_file(path, rest_dir, fsync=fsync)
    if newest:
        _prune(rest_dir, newest[-1][0], keep)
    for leftover in live_dir.iterdir() if live_dir.is_dir() else ():
        if _NAME.match(leftover.name) or leftover.name.startswith(".weights-v"):
            leftover.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: something else lives there, leave it
        live_dir.rmdir()
    return [version for version, _ in newest]


def unspill_states(rest_dir: pathlib.Path, live_dir: pathlib.Path, keep: int) -> list[int]:
    """A starting server's versions, back into its folder in memory: when `live_dir` holds no
    state file (a first start, or after the machine restarted), the newest `keep` of
    `rest_dir` are copied in (verified when the server loads them, as any state file).
    A `live_dir` that has state files is the newer copy and is left alone."""
    if _state_files(live_dir):
        return []
    newest = _newest_with_bases(_state_files(rest_dir), keep)
    for _, path in newest:
        _copy_state_file(path, live_dir, fsync=False)
    return [version for version, _ in newest]


def load_newest(state_dir: pathlib.Path) -> tuple[LoadedState | None, str | None]:
    """The newest valid state in `state_dir` and an error text if a newer file was corrupt.

    `load_states(state_dir, 1)`: see there for temporary, corrupt and unreadable files.
    """
    states, error = load_states(state_dir, 1)
    return (states[-1] if states else None), error


def load_states(
    state_dir: pathlib.Path, keep: int, *, owner: bool = False
) -> tuple[list[LoadedState], str | None]:
    """Up to `keep` newest valid states in `state_dir`, oldest first, and an error text
    naming every corrupt file met on the way.

    `owner` (the parameter server starting on its own dir): temporary files left by an
    interrupted write or file push are deleted. Any other reader (`rlax eval` on a live
    run) leaves them alone: they may be a push in progress. A corrupt file is
    renamed to ``<name>.corrupt`` (kept for inspection) and the next older file is read
    in its place. A file that cannot be read raises `StateReadError` naming it and is
    left in place: skipping it could serve an older newest version than pullers saw, or
    silently lose a version pinned work still asks for. Files are read newest first, one
    at a time and mapped, not copied (see the module docstring).
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1")
    if not state_dir.is_dir():
        return [], None
    for leftover in state_dir.glob(".weights-v*.tmp-*") if owner else ():
        log.warning("removing %s left by an interrupted write", leftover)
        leftover.unlink(missing_ok=True)
    candidates = _state_files(state_dir)
    states: list[LoadedState] = []
    errors: list[str] = []
    for _, path in reversed(candidates):
        if len(states) >= keep:
            break
        loaded = _read_or_set_aside(path, errors)
        if loaded is not None:
            states.append(loaded)
    # The bases that the loaded adapter-only versions name (`rlax_protocol.lora_versions`).
    have = {state.version for state in states}
    named = {base for state in states if (base := _base_or_none(state)) is not None} - have
    for version, path in candidates:
        if version in named and (loaded := _read_or_set_aside(path, errors)) is not None:
            states.append(loaded)
    states.sort(key=lambda state: state.version)
    return states, "; ".join(errors) or None


def _base_or_none(state: LoadedState) -> int | None:
    try:
        return lora_base_of(state.metadata, state.version)
    except LoraVersionError:
        return None  # the server refuses to install it, naming the defect


def _read_or_set_aside(path: pathlib.Path, errors: list[str]) -> LoadedState | None:
    """The verified state at `path`; a corrupt file is renamed to ``<name>.corrupt`` (its
    defect appended to `errors`) and gives None; an unreadable one raises `StateReadError`."""
    try:
        return read_state(path)
    except OSError as err:
        raise StateReadError(err.errno, f"cannot read state file {path}: {err.strerror or err}") from err
    except CorruptStateError as err:
        log.error("corrupt state file, not served: %s", err)
        errors.append(str(err))
        try:
            path.rename(path.with_name(path.name + ".corrupt"))
        except OSError as rename_error:  # a read-only state dir: still never served
            log.error("could not set %s aside: %s", path, rename_error)
        return None
