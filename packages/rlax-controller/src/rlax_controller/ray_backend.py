"""The Ray backend of `rlax launch` (`launcher.backend: ray`): every component as a Ray
actor on a cluster. `launcher.launch` runs the launch sequence; this module places,
starts, supervises (`ray_supervision`) and stops the actors (`ray_actors`).

- Connects with `ray.init(address=launcher.address, namespace=launcher.namespace)` (an
  empty address starts a local Ray; `ray://HOST:PORT` goes through Ray Client); an
  unreachable address fails within seconds (a TCP probe of HOST:PORT first), naming it.
- Placement: one placement group per role, one bundle per process of the role, each
  bundle the role's `launcher.resources` (CPUs, GPUs, memory, custom resources such as
  TPU), spread by the role's `placement` strategy (`STRICT_SPREAD`: one per node). Then one
  `RoleProcess` actor per process of the local launcher (`build_specs`) in its bundle,
  restarted by Ray up to the role's `max_restarts`, run by the role's own interpreter
  (`runtime_env.py_executable`) when `python` is set. A request no alive node can hold
  fails at once, naming the role and the resources; a group or actor still unplaced after
  `READY_TIMEOUT_S` fails naming it. When a node is lost, Ray re-places its bundles on
  nodes that have the resources, and the actors restart there.
- Addresses are discovered through Ray: every server actor (and a trainer gang's process
  0, the `jax.distributed` coordinator) reports `tcp://<its node IP>:<a free port there>`,
  the launcher writes the resolved config into the run folder, and only then is each
  actor told to start its component (the same command line as the local launcher). The
  plan of every process lives in a small registry actor on the launcher's node: an actor
  that Ray restarts reads it back and restarts its component on the SAME address, which
  the other components already know.
- A server restarted on ANOTHER node (its node was lost) cannot keep its address: it
  tells the registry, the launcher reserves a port on the new node, rewrites the config
  and the run's address book (`rlax_core.addresses`), and starts it there (`moved` in
  events.jsonl). Its clients are not restarted: each reads the new address in the book
  when it reconnects (the controller its worker links and verifier client, the trainer
  and the workers their parameter-server clients, the trainer its controller client). A
  lost process restarts alone, unless another learns its address only at start: a
  trainer gang's coordinator (the gang restarts with it) and, with `agent.where:
  service`, the verifier service of the workers' environments (`ray_cluster.address_dependents`).
- How soon Ray gives a lost node up is `launcher.health_check` (passed to the Ray the
  launcher starts; checked against an existing cluster's own). A lost process's stall, from
  the last answer of its actor (pinged every second) to its replacement serving (its
  address accepts connections; a process that is no server: started), is recorded per
  node (`node_lost` in events.jsonl and in the launcher's metrics file
  `launcher_metrics.jsonl`, with `detect_s`: how long Ray took to give the node up) and in
  the report.
- A multi-host trainer (`trainer.hosts > 1`) is a gang: when one member exits or is lost,
  the launcher stops the others and all restart together from the last checkpoint
  (`gang_restart`); exits of lives older than the gang's last restart are that restart's
  own, so one failure restarts the gang once.
- A component that exits non-zero makes its actor exit, so Ray restarts the actor; an exit
  that `restart_policy` never restarts (config rejected, component not installed in the
  role's environment) stops the run with the component's message; so does an actor that Ray gave up on (its
  `max_restarts`: `ActorDiedError` on two pings a second apart) or, with `max_restarts:
  -1`, more than `supervisor.max_restarts` failures of one process (kills by chaos, gang
  restarts and moves are not failures).
- Planned and unplanned exits, as the local supervisor tells them: an exit is planned
  when the launcher ended that life itself (a chaos kill, a gang restart, a restart for a
  move; `kill_component` names the life it ended), when it is the completing process's
  clean exit, a gang member going down after another member's exit, or a life that went
  down with its node (its next life is on another node, or it moved). Anything else (a
  crash, a component killed from outside) is unplanned: its `exit` event says `unplanned:
  true` and carries the end of that life's log (as its actor read it at the exit; for a
  life that never reported, its part of the log), and `RayReport.unplanned_restarts` lists
  it. A planned exit's event says why (`planned`). A SIGKILL nobody here explains waits
  for the process's next life (or the run's end: is its node still alive?) to be told.
- Logs: each actor appends its component's output to `<run>/logs/<process>.log`; the run
  folder must be shared storage visible to every node at the same path (it is, for the
  checkpoints, snapshots, parameter-server state and metrics, anyway). Every node each
  process ran on is written to `<run>/logs/placement.json`, and every start, exit, move,
  gang restart and chaos kill to `events.jsonl`.
- `chaos.*` works as in the local launcher: a seeded random component is SIGKILLed every
  ~`chaos.interval` seconds (through its actor), and Ray restarts its actor.
- The progress display, summary table and plot are the local launcher's; at the end, on
  an error or Ctrl-C every actor and placement group the launcher created is stopped
  (component SIGTERM, then SIGKILL) and removed, so nothing is left on the cluster.

Ray is imported only here, and only when this backend runs (`pip install
rlax-controller[ray]`); the rest of the controller never needs it.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import time
from collections.abc import Callable
from typing import Any

from rlax_controller.process_plan import write_run_files
from rlax_controller.ray_actors import registry_class, role_process_class
from rlax_controller.ray_cluster import (
    actor_options,
    address_dependents,
    check_health_config,
    check_schedulable,
    health_check_text,
    probe_cluster,
    ray_specs,
    resource_request,
    with_addresses,
)
from rlax_controller.ray_records import ProcessPlan
from rlax_controller.ray_supervision import RaySupervision
from rlax_controller.run_report import RayReport, SupervisorReport
from rlax_core.addresses import server_addresses
from rlax_core.config import AUTO, ConfigError, RunConfig
from rlax_core.fsutil import append_line
from rlax_protocol.auth import RunKeys

__all__ = ["READY_TIMEOUT_S", "STOP_GRACE_S", "RayBackend", "RayRun"]

READY_TIMEOUT_S = 45.0
STOP_GRACE_S = 5.0
_CALL_TIMEOUT_S = 30.0
_START_TIMEOUT_S = 60.0


class RayRun:
    """One run on Ray: its placement groups, actors, registry, plans and supervision."""

    def __init__(self, ray: Any, config: RunConfig, output: pathlib.Path, keys: RunKeys | None) -> None:
        self.ray = ray
        self.config = config
        self.output = output
        self.log_dir = output / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.events = self.log_dir / "events.jsonl"
        self.keys = keys  # once per run: a restarted actor presents what the others accept
        self.specs = ray_specs(config, output / "config.yaml", self.keys)
        self.roles = {s.name: s.role for s in self.specs}
        self.actors: dict[str, Any] = {}
        self.groups: dict[str, Any] = {}
        self.registry: Any = None
        self.placement: dict[str, dict[str, Any]] = {}
        self.found: dict[str, str] = {}  # process -> the tcp:// address it was given
        self.plans: dict[str, ProcessPlan] = {}
        self.health_check = ""  # the cluster's timing, in words (for the report)

    def event(self, kind: str, **fields: Any) -> None:
        append_line(self.events, json.dumps({"time": time.time(), "event": kind, **fields}))

    # ------------------------------------------------------------------ placement
    def place(self) -> None:
        """A placement group per role (one bundle per process), then one actor per process
        in its bundle; both must be placed within READY_TIMEOUT_S, or the error names the role."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray, config = self.ray, self.config
        check_schedulable(ray, config, [s.role for s in self.specs])
        # The registry lives on the launcher's own node: it goes when the launcher goes.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.registry = (
            ray.remote(registry_class())
            .options(num_cpus=0, max_restarts=0, scheduling_strategy=here)
            .remote()
        )
        cluster_health = ray.get(self.registry.health_check.remote(), timeout=READY_TIMEOUT_S)
        check_health_config(config, cluster_health)
        self.health_check = health_check_text(cluster_health)
        self.event("health_check", **cluster_health)
        members = collections.defaultdict(list)
        for spec in self.specs:
            members[spec.role].append(spec.name)
        for role, names in members.items():
            request = resource_request(config, role)
            if request:  # a role that asks for nothing needs no reservation
                self.groups[role] = placement_group(
                    [dict(request) for _ in names],
                    strategy=config.launcher.of(role).placement,
                    name=f"{config.run.name}.{role}",
                )
        deadline = time.monotonic() + READY_TIMEOUT_S
        for role, group in self.groups.items():
            try:
                ray.get(group.ready(), timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise ConfigError(
                    f"launcher.resources.{role}: the placement group of {len(members[role])} x "
                    f"{resource_request(config, role)} ({config.launcher.of(role).placement}) was not placed "
                    f"within {READY_TIMEOUT_S:g}s (busy cluster?)"
                ) from None
        actor_class = ray.remote(role_process_class())
        for spec in self.specs:
            group = self.groups.get(spec.role)
            bundle = members[spec.role].index(spec.name)
            self.actors[spec.name] = actor_class.options(
                name=f"{config.run.name}.{spec.name}", **actor_options(config, spec.role, group, bundle)
            ).remote(spec.name, self.registry, spec.completes_run)
        for spec in self.specs:
            try:
                info = ray.get(
                    self.actors[spec.name].info.remote(), timeout=max(1.0, deadline - time.monotonic())
                )
            except ray.exceptions.GetTimeoutError:
                raise ConfigError(
                    f"launcher.resources.{spec.role}: {spec.name} was not placed within "
                    f"{READY_TIMEOUT_S:g}s; it asks for {resource_request(config, spec.role)} "
                    "(busy cluster, or a runtime_env/python that does not start)"
                ) from None
            self.placement[spec.name] = {
                "role": spec.role,
                **info,
                "request": resource_request(config, spec.role),
                "nodes": [info["node_id"]],
            }

    # ------------------------------------------------------------------ addresses and plans
    def resolve(self) -> RunConfig:
        """Each server binds a free port on its own node: the config with those addresses."""
        ray = self.ray
        for name, address in server_addresses(self.config).items():
            if address == AUTO and name in self.actors:
                self.found[name] = ray.get(self.actors[name].reserve_port.remote(), timeout=_CALL_TIMEOUT_S)
        self.config = with_addresses(self.config, self.found)
        return self.config

    def replan(self) -> None:
        """Write the config and address book with the current addresses, and give the
        registry every plan (an actor Ray restarts reads its plan there)."""
        self.register_plans(write_run_files(self.config, self.output))

    def register_plans(self, resolved: pathlib.Path) -> None:
        """Give the registry every process's plan, with the config at `resolved`."""
        self.write_placement()
        cwd = os.getcwd()
        for spec in ray_specs(self.config, resolved, self.keys):
            address = self.found.get(spec.name, "")
            self.plans[spec.name] = ProcessPlan(
                argv=spec.argv,
                env=dict(spec.env or {}),
                cwd=spec.cwd or cwd,
                log=str(self.log_dir / f"{spec.name}.log"),
                # The node the address belongs to: restarted elsewhere, the actor asks for a new one.
                bind_ip=address.removeprefix("tcp://").rpartition(":")[0],
            )
            self.ray.get(
                self.registry.set_plan.remote(spec.name, self.plans[spec.name].wire()),
                timeout=_CALL_TIMEOUT_S,
            )

    def write_placement(self) -> None:
        (self.log_dir / "placement.json").write_text(json.dumps(self.placement, indent=1, sort_keys=True))

    def start(self) -> None:
        for spec in self.specs:  # servers first, as build_specs orders them
            plan = self.plans[spec.name].wire()
            pid = self.ray.get(self.actors[spec.name].start.remote(plan), timeout=_START_TIMEOUT_S)
            self.event(
                "start", name=spec.name, role=spec.role, pid=pid, node=self.placement[spec.name]["node_id"]
            )

    def move(self, name: str, node_id: str) -> list[str]:
        """`name` restarted on another node (its node was lost): give it an address there,
        rewrite the config and the address book, and start it. Its clients find it there
        through the book; the processes that learn its address at start alone
        (`address_dependents`) must restart: they are returned."""
        ray = self.ray
        # The actor told the registry from its constructor: until that returns, Ray still
        # calls it restarting and refuses calls (ActorUnavailableError).
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                address = ray.get(self.actors[name].reserve_port.remote(), timeout=_CALL_TIMEOUT_S)
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        old = self.found.get(name, "")
        self.found[name] = address
        self.config = with_addresses(self.config, self.found)
        self.placement[name]["nodes"].append(node_id)
        self.replan()
        self.event("moved", name=name, node=node_id, old=old, address=address)
        ray.get(self.actors[name].start.remote(self.plans[name].wire()), timeout=_START_TIMEOUT_S)
        return address_dependents(self.config, name)

    def teardown(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL), kill every actor and remove every
        placement group we created."""
        ray = self.ray
        stops = []
        for actor in self.actors.values():
            try:
                stops.append(actor.stop.remote(STOP_GRACE_S))
            except Exception:  # a dead actor has nothing to stop
                pass
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_GRACE_S + 10)
        for actor in [*self.actors.values(), *([self.registry] if self.registry is not None else [])]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            try:
                remove_placement_group(group)
            except Exception:
                pass
        ray.shutdown()


class RayBackend:
    """`launcher.Backend` on a Ray cluster: one actor per process."""

    def __init__(self, config: RunConfig) -> None:
        launcher = config.launcher
        probe_cluster(launcher.address)
        try:
            import ray  # the optional extra
        except ImportError as error:
            raise ConfigError(
                "launcher.backend=ray needs Ray on this machine: pip install 'rlax-controller[ray]'"
            ) from error
        self.ray = ray
        self.where = f" on Ray ({launcher.address or 'local'}, namespace {launcher.namespace})"
        self.run_on_ray: RayRun | None = None
        self._previous_sigterm: Any = None

    def plan(self, config: RunConfig) -> RunConfig:
        """The addresses stay `auto` until each server's node is known (`place`)."""
        return config

    def place(self, config: RunConfig, output: pathlib.Path, keys: RunKeys | None) -> RunConfig:
        """Join (or start) the cluster, place every process's actor, reserve each server's
        port on its node: the config with those addresses."""
        launcher, ray = config.launcher, self.ray
        health = launcher.health_check.system_config()
        ray.init(
            address=launcher.address or None,
            namespace=launcher.namespace,
            log_to_driver=False,
            include_dashboard=False if not launcher.address else None,
            # Only a Ray this call starts takes system settings; a cluster's are checked in place().
            **({"_system_config": health} if health and not launcher.address else {}),
        )
        self.run_on_ray = RayRun(ray, config, output, keys)
        self._catch_sigterm()
        self.run_on_ray.place()
        return self.run_on_ray.resolve()

    def supervise(self, resolved: pathlib.Path, on_tick: Callable[[], None]) -> SupervisorReport:
        """Start every actor's component in order, then supervise until the run ends."""
        run = self._run()
        run.register_plans(resolved)
        run.start()
        return RaySupervision(run).loop(on_tick)

    def interrupted(self, why: str, log_dir: pathlib.Path) -> SupervisorReport:
        return RayReport(False, why, {}, [], {}, log_dir)

    def stop_all(self) -> None:
        """Stop every component and remove every actor and placement group of the run."""
        if self.run_on_ray is not None:
            self.run_on_ray.teardown()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _run(self) -> RayRun:
        if self.run_on_ray is None:
            raise RuntimeError("RayBackend.place must run first")
        return self.run_on_ray

    def _catch_sigterm(self) -> None:
        def on_term(_signum: int, _frame: Any) -> None:
            # As Ctrl-C: the launch sequence stops every actor and reports the interruption.
            raise KeyboardInterrupt("SIGTERM")

        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread
            self._previous_sigterm = None
