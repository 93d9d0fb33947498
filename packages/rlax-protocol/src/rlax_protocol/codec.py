"""Tensor-tree codec: a nested dict of numpy arrays <-> a `TensorManifest` plus raw frames.

A tree such as ``{"layers": {"0": {"attn": {"q": w}}}}`` is flattened to slash paths
(``layers/0/attn/q``), sorted, and each tensor is described by a `TensorHeader`
(dtype, shape, byte length, xxh3_64 checksum). Its raw C-order bytes travel as
frames of at most `chunk_bytes`: a tensor of ``nbytes`` occupies
``max(1, ceil(nbytes / chunk_bytes))`` consecutive frames (an empty tensor: one empty
frame). Encoding never copies a C-contiguous array: frames are memoryviews of its
memory. Decoding wraps a single-frame tensor around the received buffer with
`np.frombuffer` (no copy) and joins a multi-frame tensor with one copy.
bfloat16 (from `ml_dtypes`) travels as its raw two-byte words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import ml_dtypes
import msgspec
import numpy as np
import xxhash

from rlax_protocol.errors import ChecksumError, MalformedMessageError, VersionMismatchError
from rlax_protocol.messages import DTYPE_ITEMSIZE, PROTOCOL_VERSION, TensorHeader, TensorManifest

DEFAULT_CHUNK_BYTES = 128 * 1024 * 1024
SEP = "/"

_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name) for name in DTYPE_ITEMSIZE
}


Buffer = Any
"""Anything exposing the buffer protocol: bytes, bytearray, memoryview, numpy array, `zmq.Frame`."""


def checksum(data: Buffer | bytes | memoryview) -> int:
    """xxh3_64 of the bytes, as an unsigned 64-bit integer."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_frames(frames: Sequence[Buffer]) -> int:
    """`checksum` of the frames' bytes joined, without joining them."""
    hasher = xxhash.xxh3_64()
    for frame in frames:
        hasher.update(frame)
    return hasher.intdigest()


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The wire name of a supported numpy dtype; raises ValueError for any other."""
    for name, candidate in _DTYPES.items():
        if dtype == candidate:
            return name
    raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(_DTYPES)}")


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a wire dtype name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise MalformedMessageError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def flatten_tree(tree: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Nested dict of arrays -> ``{"a/b/c": array}`` in sorted path order.

    Keys must be non-empty strings without ``/``; leaves must be numpy arrays or scalars
    of a supported dtype. Empty sub-dicts carry no tensor and vanish.
    """
    flat: dict[str, np.ndarray] = {}
    # An explicit stack, not a recursive closure: a closure that calls itself is a reference
    # cycle that kept the whole tree (a trainer's pushed weights) alive until Python's cyclic
    # garbage collector ran, and with it XLA could not reuse those buffers.
    stack: list[tuple[Mapping[str, Any], str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for key, value in node.items():
            if not isinstance(key, str) or not key or SEP in key:
                raise ValueError(
                    f"tree key {key!r} under {prefix or '<root>'!r} must be a non-empty str without '/'"
                )
            path = f"{prefix}{SEP}{key}" if prefix else key
            if isinstance(value, Mapping):
                stack.append((value, path))
            elif isinstance(value, np.ndarray | np.generic):
                array = np.asarray(value)
                if array.dtype.byteorder == ">":
                    # The wire is little-endian; a big-endian input is converted (one copy).
                    array = array.astype(array.dtype.newbyteorder("<"))
                dtype_name(array.dtype)  # validates
                flat[path] = array
            else:
                raise TypeError(f"tree leaf {path!r} is a {type(value).__name__}, expected a numpy array")
    return dict(sorted(flat.items()))


def unflatten_tree(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Inverse of `flatten_tree`; a path that is both a leaf and a prefix raises ValueError."""
    tree: dict[str, Any] = {}
    for path, array in flat.items():
        parts = path.split(SEP)
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"tensor {SEP.join(parts[: depth + 1])!r} is also a prefix of {path!r}")
            node = child
        if parts[-1] in node:
            raise ValueError(f"tensor path {path!r} collides with a subtree of the same name")
        node[parts[-1]] = array
    return tree


def _raw_bytes(array: np.ndarray) -> memoryview:
    # A uint8 view of a C-contiguous array shares its memory, which is the zero-copy path.
    contiguous = np.ascontiguousarray(array)
    return memoryview(cast(Any, contiguous.reshape(-1).view(np.uint8)))


@dataclass(frozen=True)
class EncodedTree:
    """A tree ready to send: frames are memoryviews into the original arrays (keep them alive)."""

    manifest: TensorManifest
    frames: list[memoryview]


def encode_tree(
    tree: Mapping[str, Any], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, checksums: bool = True
) -> EncodedTree:
    """Flatten `tree`, checksum each tensor, split its bytes into frames of <= `chunk_bytes`.

    With `checksums=False` every header's checksum is 0, for a sender that hashes each
    tensor while the ones before it are on the wire (`PushBegin.checksums_follow`)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be > 0")
    headers: list[TensorHeader] = []
    frames: list[memoryview] = []
    for name, array in flatten_tree(tree).items():
        raw = _raw_bytes(array)
        headers.append(
            TensorHeader(
                name=name,
                dtype=dtype_name(array.dtype),
                shape=tuple(int(d) for d in array.shape),
                nbytes=raw.nbytes,
                checksum=checksum(raw) if checksums else 0,
            )
        )
        if raw.nbytes == 0:
            frames.append(raw)
        else:
            frames.extend(raw[start : start + chunk_bytes] for start in range(0, raw.nbytes, chunk_bytes))
    manifest = TensorManifest(
        protocol_version=PROTOCOL_VERSION, chunk_bytes=chunk_bytes, tensors=tuple(headers)
    )
    return EncodedTree(manifest=manifest, frames=frames)


def frames_by_tensor(manifest: TensorManifest, frames: Sequence[Buffer]) -> list[list[Buffer]]:
    """`frames` (all of `manifest`'s, in order) grouped by tensor, in manifest order."""
    grouped: list[list[Buffer]] = []
    start = 0
    for count in manifest.frames_per_tensor():
        grouped.append(list(frames[start : start + count]))
        start += count
    if start != len(frames):
        raise ValueError(f"{len(frames)} frames for a manifest of {start}")
    return grouped


def with_checksums(encoded: EncodedTree) -> EncodedTree:
    """`encoded` (from `encode_tree(..., checksums=False)`) with every tensor's checksum."""
    grouped = frames_by_tensor(encoded.manifest, encoded.frames)
    headers = tuple(
        msgspec.structs.replace(header, checksum=checksum_frames(frames))
        for header, frames in zip(encoded.manifest.tensors, grouped)
    )
    return EncodedTree(msgspec.structs.replace(encoded.manifest, tensors=headers), encoded.frames)


@dataclass(frozen=True)
class FrameSlot:
    """Where frame `index` of a manifest belongs: tensor `tensor` at byte `offset`, `nbytes` long."""

    tensor: int
    offset: int
    nbytes: int


def frame_layout(manifest: TensorManifest) -> list[FrameSlot]:
    """One `FrameSlot` per frame of `manifest`, in frame order."""
    slots: list[FrameSlot] = []
    for index, (header, count) in enumerate(zip(manifest.tensors, manifest.frames_per_tensor())):
        for k in range(count):
            offset = k * manifest.chunk_bytes
            slots.append(FrameSlot(index, offset, min(manifest.chunk_bytes, header.nbytes - offset)))
    return slots


def check_manifest_version(manifest: TensorManifest) -> None:
    """Raise `VersionMismatchError` if the manifest was written by another protocol version."""
    if manifest.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatchError(PROTOCOL_VERSION, manifest.protocol_version, peer="manifest")


class TreeAssembler:
    """Builds a tree's arrays while its frames arrive, in any order of messages.

    `add(first_frame, frames)` places frames by index; a single-frame tensor is wrapped
    (no copy) and a multi-frame one copied into its own buffer, and each tensor is
    verified as soon as its last frame arrives, so decoding overlaps with receiving.
    Raises `MalformedMessageError` for a frame out of range, of the wrong length or
    received twice, `ChecksumError` naming a corrupt tensor.
    """

    def __init__(self, manifest: TensorManifest, *, verify: bool = True) -> None:
        check_manifest_version(manifest)
        self.manifest = manifest
        self.verify = verify
        self._slots = frame_layout(manifest)
        self._remaining = manifest.frames_per_tensor()
        self._seen = bytearray(len(self._slots))
        self._buffers: dict[int, np.ndarray] = {}
        self._arrays: dict[int, np.ndarray] = {}

    @property
    def missing_frames(self) -> int:
        return len(self._seen) - sum(self._seen)

    def add(self, first_frame: int, frames: Sequence[Buffer | bytes | memoryview]) -> None:
        if first_frame < 0 or first_frame + len(frames) > len(self._slots):
            raise MalformedMessageError(
                f"frames {first_frame}..{first_frame + len(frames) - 1} outside the manifest's {len(self._slots)} frames"
            )
        for k, frame in enumerate(frames):
            index = first_frame + k
            slot = self._slots[index]
            header = self.manifest.tensors[slot.tensor]
            view = memoryview(frame).cast("B")
            if view.nbytes != slot.nbytes:
                raise MalformedMessageError(
                    f"tensor {header.name!r} frame at byte {slot.offset} holds {view.nbytes} bytes, expected {slot.nbytes}"
                )
            if self._seen[index]:
                raise MalformedMessageError(f"frame {index} (tensor {header.name!r}) received twice")
            self._seen[index] = 1
            self._remaining[slot.tensor] -= 1
            if slot.nbytes == header.nbytes:
                self._finish(slot.tensor, view)
                continue
            joined = self._buffers.get(slot.tensor)
            if joined is None:
                joined = self._buffers[slot.tensor] = np.empty(header.nbytes, dtype=np.uint8)
            joined[slot.offset : slot.offset + slot.nbytes] = np.frombuffer(view, dtype=np.uint8)
            if self._remaining[slot.tensor] == 0:
                self._finish(slot.tensor, self._buffers.pop(slot.tensor))

    def add_tensor(self, tensor: int, data: Buffer | memoryview) -> None:
        """Place a whole tensor at once (all its frames), wrapped without a copy: e.g. a
        view of a mapped file, whose frames were never sent."""
        if not 0 <= tensor < len(self.manifest.tensors):
            raise MalformedMessageError(
                f"tensor {tensor} outside the manifest's {len(self.manifest.tensors)}"
            )
        header = self.manifest.tensors[tensor]
        view = memoryview(data).cast("B")
        if view.nbytes != header.nbytes:
            raise MalformedMessageError(
                f"tensor {header.name!r} holds {view.nbytes} bytes, expected {header.nbytes}"
            )
        indices = [i for i, slot in enumerate(self._slots) if slot.tensor == tensor]
        if any(self._seen[i] for i in indices):
            raise MalformedMessageError(f"tensor {header.name!r} received twice")
        for index in indices:
            self._seen[index] = 1
        self._remaining[tensor] = 0
        self._finish(tensor, view)

    def _finish(self, tensor: int, data: memoryview | np.ndarray) -> None:
        header = self.manifest.tensors[tensor]
        if self.verify:
            actual = checksum(cast(Any, data))
            if actual != header.checksum:
                raise ChecksumError(header.name, header.checksum, actual)
        array = np.frombuffer(data, dtype=numpy_dtype(header.dtype)).reshape(header.shape)
        array.flags.writeable = False
        self._arrays[tensor] = array

    def result(self) -> dict[str, np.ndarray]:
        """``{path: array}`` in manifest order; `MalformedMessageError` if frames are missing."""
        if self.missing_frames:
            absent = [i for i, seen in enumerate(self._seen) if not seen]
            raise MalformedMessageError(
                f"{len(absent)} of {len(self._seen)} frames never arrived (first: {absent[:5]})"
            )
        return {t.name: self._arrays[i] for i, t in enumerate(self.manifest.tensors)}


def decode_flat(
    manifest: TensorManifest, frames: Sequence[Buffer | bytes | memoryview], *, verify: bool = True
) -> dict[str, np.ndarray]:
    """Frames -> ``{path: array}`` (read-only arrays, sharing single-frame buffers).

    Raises `MalformedMessageError` when the frame count or a frame's length does not match
    the manifest (truncated, extra or reordered frames) and `ChecksumError` naming the
    tensor whose bytes do not hash to its header's checksum.
    """
    check_manifest_version(manifest)
    expected = manifest.num_frames
    if len(frames) != expected:
        raise MalformedMessageError(
            f"manifest of {len(manifest.tensors)} tensors needs {expected} frames, got {len(frames)}"
        )
    assembler = TreeAssembler(manifest, verify=verify)
    assembler.add(0, frames)
    return assembler.result()


def decode_tree(
    manifest: TensorManifest, frames: Sequence[Buffer | bytes | memoryview], *, verify: bool = True
) -> dict[str, Any]:
    """Frames -> nested dict of read-only arrays; see `decode_flat` for the errors."""
    return unflatten_tree(decode_flat(manifest, frames, verify=verify))
