"""`launcher:` how `rlax launch` runs the components (local processes or Ray actors)."""

from __future__ import annotations

from typing import Literal

import msgspec

from rlax_core.config.base import ROLES, Section, check


class RoleResources(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one process of a role asks of the cluster under `launcher.backend: ray`.

    `resources`: Ray custom resources (e.g. `{TPU: 4}` on a GKE TPU slice, or a label-like
    `{trainer_node: 1}` that only some nodes carry); `memory_gb`: Ray's heap-memory request.
    `python`: the interpreter of the role's own environment on its nodes (empty: the
    cluster's default); `max_restarts`: how often Ray restarts a process of this role that
    died (-1: without limit). `placement`: how the role's placement group spreads its
    processes over nodes (Ray's strategies; `STRICT_SPREAD` puts each on its own node, as a
    multi-host trainer gang needs on real hosts)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_gb: float = 0.0
    resources: dict[str, float] = {}
    python: str = ""
    max_restarts: int = -1
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"

    def __post_init__(self) -> None:
        check(self.num_cpus >= 0, "num_cpus", self.num_cpus, "must be >= 0")
        check(self.num_gpus >= 0, "num_gpus", self.num_gpus, "must be >= 0")
        check(self.memory_gb >= 0, "memory_gb", self.memory_gb, "must be >= 0")
        for name, amount in self.resources.items():
            check(bool(name) and amount > 0, f"resources.{name}", amount, "must be a name with an amount > 0")
        check(self.max_restarts >= -1, "max_restarts", self.max_restarts, "must be >= -1")


class HealthCheckSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How soon Ray declares a lost node dead, and so how soon the processes it ran restart
    elsewhere: Ray's head checks every node each `period_s`, waits `timeout_s` for an
    answer, and gives a node up after `failure_threshold` failed checks in a row (Ray's
    `health_check_period_ms`, `health_check_timeout_ms`, `health_check_failure_threshold`;
    0 keeps the cluster's value, Ray's defaults being 3 s, 10 s and 5). A node whose raylet
    died is refused at once and given up after about period x threshold; a host that
    vanished leaves each check to time out: about (period + timeout) x threshold. Applied
    when the launcher starts Ray itself (`launcher.address` empty); a cluster that exists
    has its own (`ray start --head --system-config='{"health_check_period_ms": 1000, ...}'`,
    or KubeRay's head `rayStartParams`), and a value set here that the cluster does not
    have stops the launch naming both. Too short, and a node that is only slow or briefly
    partitioned is given up and every process on it restarted."""

    period_s: float = 0.0
    timeout_s: float = 0.0
    failure_threshold: int = 0

    def __post_init__(self) -> None:
        check(self.period_s >= 0, "period_s", self.period_s, "must be >= 0 (0: the cluster's)")
        check(self.timeout_s >= 0, "timeout_s", self.timeout_s, "must be >= 0 (0: the cluster's)")
        check(
            self.failure_threshold >= 0,
            "failure_threshold",
            self.failure_threshold,
            "must be >= 0 (0: the cluster's)",
        )

    def system_config(self) -> dict[str, int]:
        """Ray's `_system_config` keys of the values set (those left at 0 are absent)."""
        out = {
            "health_check_period_ms": round(self.period_s * 1000),
            "health_check_timeout_ms": round(self.timeout_s * 1000),
            "health_check_failure_threshold": self.failure_threshold,
        }
        return {k: v for k, v in out.items() if v}


class LauncherSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How `rlax launch` runs the components: `local` (processes under the built-in
    supervisor) or `ray` (Ray actors on a cluster). `address`: the Ray cluster to join
    (`auto`: the one this node belongs to; `ray://HOST:PORT`: a remote one through Ray
    Client; empty: start a local one). `resources`: per role (controller, trainer, worker,
    paramserver, verifier); a role not named asks for one CPU. `health_check`: how soon Ray
    gives a lost node up (`HealthCheckSection`)."""

    backend: Literal["local", "ray"] = "local"
    address: str = ""
    namespace: str = "rlax"
    resources: dict[str, RoleResources] = {}
    health_check: HealthCheckSection = msgspec.field(default_factory=HealthCheckSection)

    def __post_init__(self) -> None:
        check(
            self.address in ("", "auto") or self.address.startswith("ray://") or ":" in self.address,
            "address",
            self.address,
            "must be empty, 'auto', 'ray://HOST:PORT' or HOST:PORT",
        )
        for role in self.resources:
            check(role in ROLES, "resources", role, f"roles are {', '.join(ROLES)}")

    def of(self, role: str) -> RoleResources:
        return self.resources.get(role, RoleResources())
