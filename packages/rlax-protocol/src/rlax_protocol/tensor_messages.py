"""Messages that describe a tensor tree sent as raw frames (see `rlax_protocol.codec`)."""

from __future__ import annotations

import math

from rlax_protocol.message_base import Message, reject_field

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Tensor dtypes the codec carries (by numpy name), with their size in bytes."""

MAX_RANK = 16


class TensorHeader(Message, frozen=True):
    """One tensor of a tree: `name` is its slash-joined path (``layers/0/attn/q``),
    `checksum` the xxh3_64 of its raw little-endian C-order bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int

    def __post_init__(self) -> None:
        # String and min() tests, not generators: every push and pull builds one per tensor.
        name = self.name
        if not name or name[0] == "/" or name[-1] == "/" or "//" in name:
            reject_field(
                "TensorHeader", "name", self.name, "must be a non-empty slash path without empty parts"
            )
        if self.dtype not in DTYPE_ITEMSIZE:
            reject_field(
                "TensorHeader", "dtype", self.dtype, f"unsupported; allowed: {sorted(DTYPE_ITEMSIZE)}"
            )
        if len(self.shape) > MAX_RANK or (self.shape and min(self.shape) < 0):
            reject_field("TensorHeader", "shape", self.shape, f"dims must be >= 0 and rank <= {MAX_RANK}")
        expected = math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]
        if self.nbytes != expected:
            reject_field(
                "TensorHeader",
                "nbytes",
                self.nbytes,
                f"shape {self.shape} of {self.dtype} holds {expected} bytes",
            )
        if not 0 <= self.checksum < 2**64:
            reject_field("TensorHeader", "checksum", self.checksum, "must be an unsigned 64-bit integer")


class TensorManifest(Message, frozen=True):
    """Describes a tensor tree sent as raw frames. Tensor ``i`` occupies
    ``max(1, ceil(nbytes / chunk_bytes))`` consecutive frames, tensors in manifest order;
    every frame but a tensor's last holds exactly `chunk_bytes` bytes."""

    protocol_version: int
    chunk_bytes: int
    tensors: tuple[TensorHeader, ...]

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            reject_field("TensorManifest", "chunk_bytes", self.chunk_bytes, "must be > 0")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            reject_field("TensorManifest", "tensors", dup, "duplicate tensor names")

    def frames_per_tensor(self) -> list[int]:
        """Number of frames each tensor occupies, in manifest order."""
        return [max(1, -(-t.nbytes // self.chunk_bytes)) for t in self.tensors]

    @property
    def num_frames(self) -> int:
        return sum(self.frames_per_tensor())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
