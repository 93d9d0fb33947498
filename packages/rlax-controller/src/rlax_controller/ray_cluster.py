"""The Ray backend's dealings with the cluster that need no actor: is it there, can it
hold every role's request, are its health-check settings the ones asked for, how each
role's actor is placed, and which processes learn a server's address only at start."""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import socket
from typing import Any

import msgspec

from rlax_controller.process_plan import ProcessSpec, build_specs
from rlax_controller.ray_records import PYTHON
from rlax_core.config import AUTO, ConfigError, RunConfig
from rlax_protocol.auth import RunKeys

__all__ = [
    "actor_options",
    "address_dependents",
    "check_health_config",
    "check_schedulable",
    "health_check_text",
    "probe_cluster",
    "ray_specs",
    "resource_request",
    "with_addresses",
]


def probe_cluster(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming it, when `launcher.address` does not answer on TCP."""
    if address in ("", "auto"):
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"launcher.address={address!r}: no Ray cluster answers there ({error}); "
            "give the head's GCS address HOST:PORT (or ray://HOST:PORT, or auto on a cluster node)"
        ) from error


def actor_options(config: RunConfig, role: str, group: Any = None, bundle: int = 0) -> dict[str, Any]:
    res = config.launcher.of(role)
    options: dict[str, Any] = {
        "num_cpus": res.num_cpus,
        "num_gpus": res.num_gpus,
        "max_restarts": res.max_restarts,
        "max_concurrency": 8,  # status calls while a start or stop is running
    }
    if res.memory_gb:
        options["memory"] = int(res.memory_gb * 2**30)
    if res.resources:
        options["resources"] = dict(res.resources)
    if res.python:
        options["runtime_env"] = {"py_executable": res.python}
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle
        )
    return options


def resource_request(config: RunConfig, role: str) -> dict[str, float]:
    res = config.launcher.of(role)
    need = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
    if res.memory_gb:
        need["memory"] = res.memory_gb * 2**30
    return {k: v for k, v in need.items() if v}


def check_schedulable(ray: Any, config: RunConfig, roles: list[str]) -> None:
    """A request that no alive node can hold fails now, naming the role and what it asks
    (and a `STRICT_SPREAD` role with fewer fitting nodes than processes)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for role, count in collections.Counter(roles).items():
        need = resource_request(config, role)
        fitting = sum(1 for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in need.items()))
        strict = config.launcher.of(role).placement == "STRICT_SPREAD"
        if fitting >= (count if strict else 1):
            continue
        have = "; ".join(
            f"{n['NodeManagerAddress']} {n['NodeID'][:8]}: "
            + ", ".join(f"{k}={v:g}" for k, v in sorted(n["Resources"].items()) if "node:" not in k)
            for n in nodes
        )
        wanted = f"{count} nodes (placement STRICT_SPREAD) with {need}" if strict else f"{need}"
        raise ConfigError(
            f"launcher.resources.{role}: no node of the Ray cluster has {wanted} "
            f"({fitting} fit; nodes: {have or 'none alive'})"
        )


def ray_specs(config: RunConfig, config_path: pathlib.Path, keys: RunKeys | None) -> list[ProcessSpec]:
    """The local launcher's processes, with each role's interpreter on its own node. Each
    plan's environment carries its role's credential: Ray hands it to the actor in memory."""
    specs = []
    for spec in build_specs(config, config_path, keys):
        python = config.launcher.of(spec.role).python or PYTHON
        specs.append(dataclasses.replace(spec, argv=[python, *spec.argv[1:]]))
    return specs


def address_dependents(config: RunConfig, name: str) -> list[str]:
    """The processes that must restart when `name` moves to another address: those that
    learn it only when they start. Every other client reads the address book when it
    reconnects, so a moved server restarts alone."""
    if name == "trainer0" and config.trainer.hosts > 1:  # the gang's jax.distributed coordinator
        return [f"trainer{i}" for i in range(1, config.trainer.hosts)]
    if name == "verifier" and config.agent.enabled and config.agent.where == "service":
        # The workers' environments step in the verifier service at the address they started with.
        return [f"worker{i}" for i in range(config.workers.count)]
    return []


def health_check_text(values: dict[str, int]) -> str:
    if not values:
        return ""
    period = values.get("health_check_period_ms", 0) / 1000
    timeout = values.get("health_check_timeout_ms", 0) / 1000
    threshold = values.get("health_check_failure_threshold", 0)
    return (
        f"period {period:g}s, timeout {timeout:g}s, threshold {threshold}: a node whose raylet died "
        f"is given up after ~{period * threshold:g}s, a vanished host after ~{(period + timeout) * threshold:g}s"
    )


def check_health_config(config: RunConfig, cluster: dict[str, int]) -> None:
    """`launcher.health_check` values the cluster does not have stop the launch, naming both."""
    wanted = config.launcher.health_check.system_config()
    if not wanted:
        return
    if not cluster:
        raise ConfigError(
            f"launcher.health_check={wanted}: the cluster's own settings cannot be read here to "
            "check them; set them on the cluster (ray start --head --system-config=...) and remove them"
        )
    differ = {k: (v, cluster.get(k)) for k, v in wanted.items() if cluster.get(k) != v}
    if differ:
        raise ConfigError(
            "launcher.health_check: the Ray cluster has "
            + ", ".join(f"{k}={have} (asked: {want})" for k, (want, have) in differ.items())
            + "; a cluster that exists keeps its own: start its head with "
            + f"ray start --head --system-config='{json.dumps(wanted)}' (KubeRay: the head's "
            + "rayStartParams), or leave launcher.health_check out"
        )


def with_addresses(config: RunConfig, found: dict[str, str]) -> RunConfig:
    """`config` with the addresses `found` on the nodes (process name -> tcp://IP:PORT)."""
    workers = list(config.workers.addresses) or [AUTO] * config.workers.count
    coordinator = found.get("trainer0", "").removeprefix("tcp://") or config.trainer.coordinator
    return msgspec.structs.replace(
        config,
        trainer=msgspec.structs.replace(config.trainer, coordinator=coordinator),
        controller=msgspec.structs.replace(
            config.controller, address=found.get("controller", config.controller.address)
        ),
        paramserver=msgspec.structs.replace(
            config.paramserver, address=found.get("paramserver", config.paramserver.address)
        ),
        verifier=msgspec.structs.replace(
            config.verifier, address=found.get("verifier", config.verifier.address)
        ),
        workers=msgspec.structs.replace(
            config.workers, addresses=[found.get(f"worker{i}", a) for i, a in enumerate(workers)]
        ),
    )
