"""Device mesh with `data`, `fsdp` and `tensor` axes, and the sharding of params, optimizer state and batches.

- `tensor`: Megatron-style: column-parallel q/k/v/gate/up and the vocabulary of the
  embedding/lm head; row-parallel o/down projections.
- `fsdp`: every parameter (and its optimizer moments) is split along its largest
  remaining dimension divisible by the axis size; XLA gathers it for the matmuls.
- batches are split over `data` x `fsdp` along the row axis.

Works the same for one process and for many processes joined by `jax.distributed`
(arrays are built from each process's copy of the host data with `make_array_from_callback`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import msgspec
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "MeshConfig",
    "batch_sharding",
    "make_mesh",
    "param_sharding",
    "put_global",
    "replicated",
    "to_host",
]

AXES = ("data", "fsdp", "tensor")
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_bias", "k_bias", "v_bias", "lm_head"}
_ROW = {"o_proj", "down_proj"}


class MeshConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Axis sizes; their product must equal the number of devices used."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    need = cfg.data * cfg.fsdp * cfg.tensor
    if need != len(devices):
        raise ValueError(
            f"mesh data={cfg.data} x fsdp={cfg.fsdp} x tensor={cfg.tensor} = {need} devices, but {len(devices)} given"
        )
    return Mesh(np.array(devices, dtype=object).reshape(cfg.data, cfg.fsdp, cfg.tensor), AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over data x fsdp; other axes replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def _leaf_spec(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    keys = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
    name = str(keys[-1]) if keys else ""
    stacked = "layers" in keys  # leading [num_layers] axis: scanned over, never split
    spec: list[Any] = [None] * len(shape)
    tp, fs = mesh.shape["tensor"], mesh.shape["fsdp"]
    if tp > 1 and shape:
        dim = None
        if name in _COLUMN:
            dim = len(shape) - 1
        elif name in _ROW:
            dim = len(shape) - 2
        elif name == "embed":
            dim = 0
        if dim is not None and dim >= int(stacked) and shape[dim] % tp == 0:
            spec[dim] = "tensor"
    if fs > 1:
        candidates = [d for d in range(int(stacked), len(shape)) if spec[d] is None and shape[d] % fs == 0]
        if candidates:
            spec[max(candidates, key=lambda d: shape[d])] = "fsdp"
    return PartitionSpec(*spec)


def param_sharding(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of a parameter tree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, _leaf_spec(path, tuple(x.shape), mesh)), tree
    )


def put_global(tree: Any, shardings: Any) -> Any:
    """Place host data (identical on every process) onto global sharded arrays."""

    def put(x: Any, s: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array) and getattr(x, "sharding", None) == s:
            return x
        host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) and x.is_fully_addressable else x
        if isinstance(host, jax.Array):
            placed: jax.Array = jax.jit(lambda y: y, out_shardings=s)(host)
            return placed
        host = np.asarray(host)
        out: jax.Array = jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
        return out

    return jax.tree.map(put, tree, shardings)


def to_host(tree: Any) -> Any:
    """Global arrays -> numpy on every process (gathers across processes when needed)."""

    def get(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(get, tree)
