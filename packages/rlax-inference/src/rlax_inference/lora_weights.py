"""A LoRA run's versions on a worker: the base pulled once, each version's adapters merged in.

A LoRA run publishes its frozen base once as a full version and every later version as the
adapters alone (`rlax_protocol.lora_versions`). A worker keeps the base (the base version it
loaded, or pulled once and checked against the SHA-256 an adapter version names) and turns
each adapter version into engine weights, merged (W + scale * A @ B per target computed in
float32 and rounded once to the engine's dtype, `rlax_model.lora.merge_adapters`: decoding
costs what the base costs) or unmerged (`with_adapters`: the low-rank path runs in every
forward; a switch costs the adapters' bytes alone). Either way a switch never pulls the
whole model. Measured on SmolLM2 (bench_lora_sync.py, docs/lora.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from rlax_model import Params
from rlax_model.lora import merge_adapters, with_adapters
from rlax_paramserver import PulledWeights
from rlax_protocol.errors import ProtocolError
from rlax_protocol.lora_versions import (
    LORA_BASE_SHA256,
    LORA_SCALE,
    LoraLayout,
    LoraVersionError,
    lora_base_of,
    lora_layout_of,
    tree_sha256,
)

__all__ = ["LoraApply", "LoraBase", "as_params"]

log = logging.getLogger("rlax.worker")

# One program per adapter layout and scale (a run has one): the add and the rounding fuse,
# and no full-size float32 intermediate outlives a target.
_merge = jax.jit(merge_adapters, static_argnums=2)


def as_params(tree: Any, dtype: Any) -> Params:
    """A pulled tree (numpy arrays) as JAX arrays of `dtype`."""
    params: Params = jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), tree)
    return params


LoraApply = Literal["merged", "unmerged"]


class LoraBase:
    """The base of a LoRA run's versions on a worker, and its adapters applied to it.

    `pull_version(v)`: the parameter server's version v, whole (the base's pull, when the
    worker did not load the base version itself). `apply`: "unmerged" (the base's arrays as
    they are plus the low-rank path in every forward: a switch costs the adapters' pull
    alone; from the base version on, the engine holds zero adapters of the announced
    layout, so its programs never change shape) or "merged" (W + scale * A @ B per target,
    one jitted merge per switch; decoding costs what the base costs)."""

    def __init__(
        self, pull_version: Callable[[int], PulledWeights | None], apply: LoraApply = "unmerged"
    ) -> None:
        if apply not in ("merged", "unmerged"):
            raise ValueError(f"apply={apply!r}: must be 'merged' or 'unmerged'")
        self._pull_version = pull_version
        self.apply = apply
        self._digest: str | None = None
        self._base: Params | None = None
        self.base_pulls = 0

    def params(self, pulled: PulledWeights, dtype: Any) -> Params | None:
        """Engine weights in `dtype` of a LoRA run's version: an adapter-only version's
        adapters applied to the base (pulled first if this worker holds no such base), or
        the base version itself (kept as the base; unmerged, with zero adapters attached).
        None for any other version. Raises `LoraVersionError` for malformed LoRA metadata,
        `ProtocolError` when the base cannot be pulled or is not the one the adapters name."""
        base_version = lora_base_of(pulled.metadata, pulled.version)
        if base_version is None:
            layout = lora_layout_of(pulled.metadata)
            if layout is None:
                return None
            self._base = None  # the old base is not kept alive beside the new one
            self._base = as_params(pulled.tree, dtype)
            self._digest = tree_sha256(pulled.tree)
            if self.apply == "merged":
                return self._base
            zeros = _zero_adapters(self._base, layout, dtype)
            return with_adapters(self._base, zeros, layout.scale)
        digest = pulled.metadata[LORA_BASE_SHA256]
        if self._digest != digest or self._base is None:
            self._base = None
            self._base = self._load_base(base_version, digest, dtype)
            self._digest = digest
        scale = float(pulled.metadata[LORA_SCALE])
        if self.apply == "unmerged":
            return with_adapters(self._base, as_params(pulled.tree["lora"], dtype), scale)
        return dict(_merge(self._base, as_params(pulled.tree["lora"], jnp.float32), scale))

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


def _zero_adapters(base: Params, layout: LoraLayout, dtype: Any) -> Any:
    """Adapters of `layout` that change nothing (A and B zero), in `dtype`."""
    layers = base["layers"]
    zeros = {}
    for name in layout.targets:
        if name not in layers:
            raise LoraVersionError(f"lora_targets names {name!r}, which the model does not have")
        n, fan_in, fan_out = layers[name].shape
        zeros[name] = {
            "a": jnp.zeros((n, fan_in, layout.rank), dtype),
            "b": jnp.zeros((n, layout.rank, fan_out), dtype),
        }
    return zeros
