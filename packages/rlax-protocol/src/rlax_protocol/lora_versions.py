"""Adapter-only weight versions of a LoRA run, as the parameter server and its pullers see them.

A LoRA run publishes its frozen base once, as an ordinary full version (the first one: with
zero-initialised B the policy before any update is the base exactly), with the adapters'
layout in its metadata:

    lora_rank          int        r: A [L, in, r], B [L, r, out]
    lora_targets       list[str]  the adapted linear layers (``q_proj``, ...)
    lora_scale         float      alpha / rank: weights = base + lora_scale * A @ B per target

Every later version holds the adapters alone (``lora/<layer>/{a, b}``, in the run's publish
dtype) and names its base in the metadata:

    lora_base_version  int    the version that holds the full base weights
    lora_base_sha256   str    `tree_sha256` of the base as pushed (a puller checks it once)
    lora_scale         float  as above

The parameter server keeps a base version while any version it holds names it, in memory
and on disk, beyond its `keep` newest; it refuses a version whose base it does not hold, so
that no puller is ever given adapters it cannot apply. No JAX here: the parameter server
reads these keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlax_protocol.codec import _raw_bytes, dtype_name, flatten_tree

__all__ = [
    "LORA_BASE_SHA256",
    "LORA_BASE_VERSION",
    "LORA_RANK",
    "LORA_SCALE",
    "LORA_TARGETS",
    "LoraLayout",
    "LoraVersionError",
    "lora_base_of",
    "lora_layout_of",
    "tree_sha256",
]

LORA_BASE_VERSION = "lora_base_version"
LORA_BASE_SHA256 = "lora_base_sha256"
LORA_SCALE = "lora_scale"
LORA_RANK = "lora_rank"
LORA_TARGETS = "lora_targets"


class LoraVersionError(ValueError):
    """A version's LoRA metadata is malformed (names what is wrong)."""


def lora_base_of(metadata: Mapping[str, Any], version: int | None = None) -> int | None:
    """The base version an adapter-only version names, or None for a full version.

    Raises `LoraVersionError` when the keys are there but wrong: a base that is not an
    integer below `version`, a digest that is not 64 hex digits, a scale that is not a
    positive number."""
    base = metadata.get(LORA_BASE_VERSION)
    if base is None:
        return None
    if type(base) is not int or base < 0 or (version is not None and base >= version):
        raise LoraVersionError(
            f"{LORA_BASE_VERSION}={base!r}: must be an integer >= 0 below the version itself ({version})"
        )
    digest = metadata.get(LORA_BASE_SHA256)
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise LoraVersionError(f"{LORA_BASE_SHA256}={digest!r}: must be 64 lowercase hex digits")
    scale = metadata.get(LORA_SCALE)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not 0 < scale < float("inf"):
        raise LoraVersionError(f"{LORA_SCALE}={scale!r}: must be a positive number")
    return base


@dataclass(frozen=True)
class LoraLayout:
    """The adapters a LoRA run's versions carry, as its base version announces them."""

    rank: int
    targets: tuple[str, ...]
    scale: float


def lora_layout_of(metadata: Mapping[str, Any]) -> LoraLayout | None:
    """The adapter layout a LoRA run's base version announces, or None (any other version).
    Raises `LoraVersionError` naming a malformed key."""
    rank = metadata.get(LORA_RANK)
    if rank is None:
        return None
    if type(rank) is not int or rank < 1:
        raise LoraVersionError(f"{LORA_RANK}={rank!r}: must be an integer >= 1")
    targets = metadata.get(LORA_TARGETS)
    if (
        not isinstance(targets, list | tuple)
        or not targets
        or not all(isinstance(t, str) and t.isidentifier() for t in targets)
        or len(set(targets)) != len(targets)
    ):
        raise LoraVersionError(f"{LORA_TARGETS}={targets!r}: must be distinct layer names")
    scale = metadata.get(LORA_SCALE)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not 0 < scale < float("inf"):
        raise LoraVersionError(f"{LORA_SCALE}={scale!r}: must be a positive number")
    return LoraLayout(rank, tuple(targets), float(scale))


def tree_sha256(tree: Mapping[str, Any]) -> str:
    """SHA-256 of a tensor tree's content: every tensor's path, dtype, shape and raw bytes,
    in sorted path order (the same digest for the trainer's arrays and a puller's)."""
    digest = hashlib.sha256()
    for name, array in flatten_tree(tree).items():
        digest.update(f"{name}\0{dtype_name(array.dtype)}\0{tuple(array.shape)}\0".encode())
        digest.update(_raw_bytes(array))
    return digest.hexdigest()
