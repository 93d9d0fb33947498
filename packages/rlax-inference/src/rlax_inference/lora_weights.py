"""A LoRA run's versions on a worker: the base pulled once, each version's adapters merged in.

A LoRA run publishes its frozen base once as a full version and every later version as the
adapters alone (`rlax_protocol.lora_versions`). A worker keeps the base it pulled (checked
against the version's SHA-256, once) and turns each adapter version into engine weights by
merging, W + scale * A @ B per target computed in float32 and rounded once to the engine's
dtype (`rlax_model.lora.merge_adapters`): decoding then costs what the base costs, and a
switch costs the adapters' bytes on the wire plus one merge, not a pull of the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rlax_model import Params
from rlax_model.lora import merge_adapters
from rlax_paramserver import PulledWeights
from rlax_protocol.errors import ProtocolError
from rlax_protocol.lora_versions import LORA_BASE_SHA256, LORA_SCALE, lora_base_of, tree_sha256

__all__ = ["LoraBase", "as_params"]

log = logging.getLogger("rlax.worker")

# One program per adapter layout and scale (a run has one): the add and the rounding fuse,
# and no full-size float32 intermediate outlives a target.
_merge = jax.jit(merge_adapters, static_argnums=2)


def as_params(tree: Any, dtype: Any) -> Params:
    """A pulled tree (numpy arrays) as JAX arrays of `dtype`."""
    params: Params = jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), tree)
    return params


class LoraBase:
    """The base of a LoRA run's versions, pulled once per worker, and the merge onto it.

    `pull_version(v)`: the parameter server's version v, whole (the base's pull)."""

    def __init__(self, pull_version: Callable[[int], PulledWeights | None]) -> None:
        self._pull_version = pull_version
        self._digest: str | None = None
        self._base: Params | None = None
        self.base_pulls = 0

    @staticmethod
    def names_a_base(pulled: PulledWeights) -> bool:
        """Whether `pulled` is an adapter-only version (raises `LoraVersionError` when its
        LoRA metadata is malformed)."""
        return lora_base_of(pulled.metadata, pulled.version) is not None

    def params(self, pulled: PulledWeights, dtype: Any) -> Params:
        """Engine weights of the adapter-only version `pulled`, in `dtype`: its adapters
        merged into the base (pulled first if this worker does not hold it yet)."""
        base_version = lora_base_of(pulled.metadata, pulled.version)
        assert base_version is not None, "params() takes an adapter-only version"
        digest = pulled.metadata[LORA_BASE_SHA256]
        if self._digest != digest or self._base is None:
            self._base = None  # the old base is not kept alive beside the new one
            self._base = self._load_base(base_version, digest, dtype)
            self._digest = digest
        adapters = as_params(pulled.tree["lora"], jnp.float32)
        return dict(_merge(self._base, adapters, float(pulled.metadata[LORA_SCALE])))

    def _load_base(self, version: int, digest: str, dtype: Any) -> Params:
        pulled = self._pull_version(version)
        if pulled is None:
            raise ProtocolError(f"base version {version} of the LoRA run could not be pulled")
        got = tree_sha256(pulled.tree)
        if got != digest:
            raise ProtocolError(
                f"base version {version} has SHA-256 {got[:16]}..., the adapters were trained on "
                f"{digest[:16]}...: not the run's base"
            )
        self.base_pulls += 1
        log.info("pulled the LoRA base (version %d, %s...)", version, digest[:16])
        return as_params(pulled.tree, dtype)
