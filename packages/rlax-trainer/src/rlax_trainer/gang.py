"""A trainer gang: `trainer.hosts` processes joined by `jax.distributed` into one JAX program.

Every process runs the same Python control flow and therefore the same collectives in the
same order; only process 0 (the leader) talks to the controller and the parameter server.
What the leader learns that decides the control flow (a controller reply, "the parameter
server already has this version") reaches the others through `Gang.broadcast_bytes` /
`Gang.broadcast_flag`, collectives over every device of the gang.

Losing a peer: the coordination service (in process 0) and every client exchange
heartbeats; a process whose peer stops answering for `heartbeat_timeout_s` (or whose
coordinator is gone) is aborted by the JAX runtime (SIGABRT, exit code 134), so a member
never waits for a dead peer longer than about that timeout, wherever it is blocked
(a collective, a checkpoint barrier, the shutdown barrier at exit).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from rlax_core.config import ConfigError, RunConfig
from rlax_trainer.sharding import MeshConfig, make_mesh

__all__ = ["Gang", "gang_mesh", "join_gang", "mesh_axes"]

log = logging.getLogger("rlax.trainer")

_MIN_BUCKET = 1024  # bytes: broadcast payloads are padded to a power of two (few compiles)


class Gang:
    """This process's place in the trainer gang (`size == 1`: a lone trainer, no collectives)."""

    def __init__(self, process_id: int = 0, size: int = 1) -> None:
        if not 0 <= process_id < size:
            raise ValueError(f"process_id {process_id} is not in 0..{size - 1}")
        self.process_id = process_id
        self.size = size

    @property
    def leader(self) -> bool:
        """Process 0: the one that talks to the controller and the parameter server."""
        return self.process_id == 0

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The leader's `payload` on every process (the others pass None). A collective:
        every process of the gang must call it at the same point of its control flow."""
        if self.size == 1:
            assert payload is not None
            return payload
        if self.leader and payload is None:
            raise ValueError("the leader must pass the payload it broadcasts")
        # (a leader's payload is not None: checked above)
        size = np.asarray([len(payload) if self.leader and payload is not None else 0], np.int32)
        n = int(multihost_utils.broadcast_one_to_all(size)[0])
        bucket = max(_MIN_BUCKET, 1 << math.ceil(math.log2(max(n, 1))))
        buf = np.zeros(bucket, np.uint8)
        if self.leader and payload is not None:
            buf[:n] = np.frombuffer(payload, np.uint8)
        out = multihost_utils.broadcast_one_to_all(buf)
        return np.asarray(out, np.uint8)[:n].tobytes()

    def broadcast_flag(self, value: bool | None) -> bool:
        """The leader's decision on every process (the others pass None); a collective."""
        if self.size == 1:
            return bool(value)
        flag = np.asarray([1 if (self.leader and value) else 0], np.int32)
        return bool(int(multihost_utils.broadcast_one_to_all(flag)[0]))


def _uses_cpu(platform: str) -> bool:
    names = platform or os.environ.get("JAX_PLATFORMS", "")
    return not names or "cpu" in names.split(",")


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host in ("::1", "[::1]")


def join_gang(config: RunConfig, process_id: int) -> Gang:
    """Join the gang of `config.trainer.hosts` processes as `process_id`; must run before
    any JAX computation. A lone trainer (hosts == 1) joins nothing.

    Timeouts: waiting for the other members at start is bounded by
    `controller.request_timeout_s`; a lost peer ends this process within about
    `controller.heartbeat_timeout_s` (the JAX runtime aborts it), and so does the barrier
    of `jax.distributed.shutdown` at exit when a peer is gone.
    """
    hosts = config.trainer.hosts
    if not 0 <= process_id < hosts:
        raise ConfigError(f"--process-id {process_id}: trainer.hosts = {hosts} (ids 0..{hosts - 1})")
    if hosts == 1:
        return Gang()
    if _uses_cpu(config.trainer.platform):
        # XLA's CPU backend has no cross-process collectives of its own.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Its preemption notifier takes over SIGTERM: the supervisor's stop would then wait for
    # the grace period and SIGKILL instead of the process exiting through its `finally`s.
    jax.config.update("jax_enable_preemption_service", False)
    address = config.trainer.coordinator
    host, port = address.rsplit(":", 1)
    heartbeat = max(1, math.ceil(config.controller.heartbeat_timeout_s))
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=hosts,
        process_id=process_id,
        initialization_timeout=max(1, math.ceil(config.controller.request_timeout_s)),
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=heartbeat,
        # JAX binds the coordinator to every interface by default; a loopback address stays
        # on loopback (on a cluster, process 0's address is reachable by its peers anyway).
        coordinator_bind_address=f"{host}:{port}" if _is_loopback(host) else None,
    )
    log.info(
        "joined the trainer gang as process %d of %d (coordinator %s; %d devices in all, %d here)",
        process_id,
        hosts,
        address,
        jax.device_count(),
        jax.local_device_count(),
    )
    return Gang(process_id, hosts)


def gang_mesh(config: RunConfig) -> Any:
    """The (data, fsdp, tensor) mesh over every device of the gang from `trainer.mesh`
    (axes not named are 1, except `fsdp`, which takes the devices left: an empty mesh puts
    every device on fsdp); None for a lone trainer without `trainer.mesh` (one device)."""
    if config.trainer.hosts == 1 and not config.trainer.mesh:
        return None
    axes = mesh_axes(config, jax.device_count())
    try:
        return make_mesh(MeshConfig(**axes))
    except ValueError as error:
        raise ConfigError(f"trainer.mesh = {dict(config.trainer.mesh)}: {error}") from None


def mesh_axes(config: RunConfig, devices: int) -> dict[str, int]:
    """The (data, fsdp, tensor) sizes of `trainer.mesh` over `devices` devices (`fsdp`, when
    not named, takes the devices left); a `ConfigError` when they cannot use exactly those
    devices. `rlax launch` asks this of a count taken before anything starts."""
    asked = dict(config.trainer.mesh)
    axes = {"data": 1, "tensor": 1, **asked}
    where = f"{devices} device(s) of platform {config.trainer.platform or 'default'!r}"
    if config.trainer.hosts > 1:
        where += f" over trainer.hosts = {config.trainer.hosts}"
    if "fsdp" not in axes:
        rest = axes["data"] * axes["tensor"]
        if devices % rest:
            raise ConfigError(f"trainer.mesh = {asked}: data x tensor = {rest} does not divide the {where}")
        axes["fsdp"] = devices // rest
    need = axes["data"] * axes["fsdp"] * axes["tensor"]
    if need != devices:
        raise ConfigError(
            f"trainer.mesh = {asked}: data x fsdp x tensor = {need} devices, but the trainer has {where}"
        )
    return axes
