"""`rlax launch` with `launcher.backend: ray`: every component as a Ray actor on a cluster.

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
  service`, the verifier service of the workers' environments (`_address_dependents`).
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
- A component that exits non-zero makes its actor exit, so Ray restarts the actor; exit 78
  (config rejected) or 69 (component not installed in the role's environment) stop the
  run with the component's message; so does an actor that Ray gave up on (its
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
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import time
from typing import Any

import msgspec
from rich.console import Console

from rlax_controller.launcher import _MetricsTail, build_specs, resolve_addresses, run_keys, summarise
from rlax_controller.metrics import ProgressDisplay, read_metrics
from rlax_controller.preflight import validate_components
from rlax_controller.supervisor import UNPLANNED_TAIL_LINES, SupervisorReport, UnplannedRestart, _tail
from rlax_core.addresses import ADDRESS_BOOK, server_addresses, write_address_book
from rlax_core.config import AUTO, EXIT_CONFIG_ERROR, ConfigError, RunConfig, dump_config, load_config
from rlax_core.fsutil import append_line
from rlax_protocol.auth import RunKeys

__all__ = ["READY_TIMEOUT_S", "RayReport", "launch"]

EXIT_MISSING_COMPONENT = 69  # rlax_core.cli: the role's package is not installed in its environment
LOST_EXIT = -9  # the exit recorded for a life that went down with its node (as if SIGKILLed)
TAIL_LINES = UNPLANNED_TAIL_LINES  # the end of a life's log that an unplanned exit carries
READY_TIMEOUT_S = 45.0
LAUNCHER_METRICS = "launcher_metrics.jsonl"  # the launcher's metrics records (node losses)
PYTHON = "{python}"  # in a command: the interpreter of the actor that runs it
_STOP_GRACE_S = 5.0


def _registry_class() -> type:
    """The plan of every process and what happened to it, kept by one small actor. Every
    start, exit and move takes the next number of one sequence, so the launcher can tell
    which life of a process an exit belongs to (a gang restarts once per failure)."""

    class Registry:
        def __init__(self) -> None:
            self.plans: dict[str, dict[str, Any]] = {}
            self.state: dict[str, dict[str, Any]] = {}
            self.seq = 0
            # Kept out of the snapshot (read only for an unplanned exit): where each life's
            # output starts in its log, and the end of each life's log as its actor read it
            # at the exit.
            self.log_starts: dict[str, list[tuple[int, int]]] = {}
            self.tails: dict[tuple[str, int], str] = {}

        def _entry(self, name: str) -> dict[str, Any]:
            return self.state.setdefault(
                name, {"starts": 0, "exits": [], "exit_runs": [], "final": None, "run": 0}
            )

        def set_plan(self, name: str, plan: dict[str, Any]) -> None:
            self.plans[name] = plan

        def plan(self, name: str) -> dict[str, Any] | None:
            return self.plans.get(name)

        def _close_lost_life(self, entry: dict[str, Any]) -> None:
            # A life that never reported its exit went down with its node (or its actor).
            if entry["starts"] > len(entry["exits"]):
                self.seq += 1
                entry["exits"].append(LOST_EXIT)
                entry["exit_runs"].append(entry["run"])
                # Told apart from a SIGKILLed component's own exit (-9 as well): the node it was on.
                lost = {"run": entry["run"], "node_id": entry.get("node", {}).get("node_id", "")}
                entry.setdefault("lost", []).append(lost)

        def started(self, name: str, node: dict[str, Any], log_offset: int = 0) -> int:
            entry = self._entry(name)
            self._close_lost_life(entry)
            self.seq += 1
            entry["starts"] += 1
            entry["node"] = node
            entry["run"] = self.seq
            # The node of every life: an exit followed by a life on another node went down with its node.
            entry.setdefault("life_nodes", {})[self.seq] = node.get("node_id", "")
            entry.pop("moved", None)
            self.log_starts.setdefault(name, []).append((self.seq, log_offset))
            return self.seq

        def exited(self, name: str, code: int, final: bool, run: int, log_tail: str = "") -> None:
            self.seq += 1
            entry = self._entry(name)
            entry["exits"].append(code)
            entry["exit_runs"].append(run)
            if final:
                entry["final"] = code
            self.tails[(name, run)] = log_tail

        def life_log(self, name: str, run: int) -> dict[str, Any]:
            """Where life `run` of `name` wrote in its log: `start` (byte offset), `end` (the
            next life's start; None: to the end), and `tail`, what its actor read there at
            the exit (None: it never reported one)."""
            starts = self.log_starts.get(name, [])
            start = next((offset for life, offset in starts if life == run), 0)
            end = next((offset for life, offset in starts if life > run), None)
            return {"start": start, "end": end, "tail": self.tails.get((name, run))}

        def moved(self, name: str, node: dict[str, Any]) -> None:
            """Restarted on a node other than the one its address is on: waits for a new plan."""
            entry = self._entry(name)
            self._close_lost_life(entry)
            self.seq += 1
            entry["moved"] = {**node, "seq": self.seq}

        def snapshot(self) -> dict[str, Any]:
            return {"seq": self.seq, "procs": self.state}

        def health_check(self) -> dict[str, int]:
            """The cluster's health-check settings, as this actor's process got them."""
            try:
                from ray._raylet import Config
            except ImportError:
                return {}
            names = ("health_check_period_ms", "health_check_timeout_ms", "health_check_failure_threshold")
            return {name: int(getattr(Config, name)()) for name in names if hasattr(Config, name)}

    return Registry


@dataclasses.dataclass
class RayReport(SupervisorReport):
    """The local report, and the stall of every node lost during the run (`node_lost`
    records: `stall_s` from the loss to every replacement serving, `detect_s` until Ray
    gave the node up) and the cluster's health-check timing."""

    stalls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    health_check: str = ""

    def render(self) -> str:
        lines = [super().render()]
        for stall in self.stalls:
            lines.append(
                f"  {stall['event'].replace('_', ' ')} {stall['node'][:8]} ({', '.join(stall['processes'])}): "
                f"{stall['stall_s']:.1f}s from the loss to its replacements serving, "
                f"{stall['detect_s']:.1f}s of it until Ray gave the node up"
            )
        if self.health_check:
            lines.append(f"  ray health check: {self.health_check}")
        return "\n".join(lines)


def _role_process_class() -> type:
    """The actor that runs one component. Built in a function so that Ray ships it by
    value: a node needs ray and the role's package, not rlax-controller."""

    class RoleProcess:
        def __init__(self, name: str, registry: Any, completes_run: bool) -> None:
            import threading

            import ray

            self.name = name
            self.registry = registry
            self.completes_run = completes_run
            self.popen: Any = None
            self.lock = threading.Lock()
            self.node = {
                "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(),
                "actor_pid": os.getpid(),
            }
            self.run = 0
            plan = ray.get(registry.plan.remote(name))
            if plan is None:
                return  # first life: the launcher plans, then calls start
            if plan.get("bind_ip") and plan["bind_ip"] != self.node["node_ip"]:
                # Restarted on another node (its node was lost): the known address is not
                # this node's, so the launcher gives it a new one and restarts its clients.
                ray.get(registry.moved.remote(name, self.node))
                return
            self.start(plan)  # restarted by Ray: the component again, on its known address

        def info(self) -> dict[str, Any]:
            return self.node

        def reserve_port(self) -> str:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((self.node["node_ip"], 0))
                return f"tcp://{self.node['node_ip']}:{sock.getsockname()[1]}"

        def start(self, plan: dict[str, Any]) -> int:
            import subprocess
            import sys
            import threading

            import ray

            argv = [sys.executable if a == PYTHON else a for a in plan["argv"]]
            env = {**os.environ, **plan["env"]}
            log_path = pathlib.Path(plan["log"])
            log_path.parent.mkdir(parents=True, exist_ok=True)
            cwd = plan["cwd"] if plan["cwd"] and os.path.isdir(plan["cwd"]) else None

            def die_with_parent() -> None:  # the component never outlives its actor
                os.setsid()
                try:
                    import ctypes

                    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                except OSError:
                    pass

            # The lock covers the registry's answer too: a kill names the life it ended.
            with self.lock:
                with open(log_path, "ab") as log:
                    offset = log.seek(0, os.SEEK_END)
                    log.write(f"--- {self.name} starting on {self.node} ---\n".encode())
                    log.flush()
                    popen = subprocess.Popen(
                        argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=cwd,
                        preexec_fn=die_with_parent,
                    )
                self.popen = popen
                self.run = ray.get(
                    self.registry.started.remote(self.name, {**self.node, "pid": popen.pid}, offset)
                )
            threading.Thread(
                target=self._watch, args=(popen, self.run, log_path, offset), daemon=True
            ).start()
            return int(popen.pid)

        def _watch(self, popen: Any, run: int, log_path: pathlib.Path, offset: int) -> None:
            import ray

            code = popen.wait()
            if popen is not self.popen:
                return  # stopped by the launcher (the run's end)
            final = (code == 0 and self.completes_run) or code in (78, EXIT_MISSING_COMPONENT)
            tail = ""
            try:  # the end of what this life wrote (a crash's traceback), read on its own node
                with open(log_path, "rb") as log:
                    end = log.seek(0, os.SEEK_END)
                    log.seek(max(offset, end - 65536))
                    tail = "\n".join(log.read().decode(errors="replace").splitlines()[-TAIL_LINES:])
            except OSError:
                pass
            try:
                ray.get(self.registry.exited.remote(self.name, code, final, run, tail))
            except Exception:  # the launcher is going away: nothing to tell
                pass
            if not final:
                os._exit(1)  # the actor dies with its component: Ray restarts it (max_restarts)

        def pid(self) -> int:
            return -1 if self.popen is None else int(self.popen.pid)

        def kill_component(self) -> int:
            """SIGKILL the component's process group (the actor then restarts): the life it
            ended (the registry's number), 0 when no component is running."""
            with self.lock:
                if self.popen is not None and self.popen.poll() is None:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                    return int(self.run)
                return 0

        def stop(self, grace_s: float) -> None:
            popen, self.popen = self.popen, None
            if popen is None or popen.poll() is not None:
                return
            try:
                os.killpg(popen.pid, signal.SIGTERM)
                popen.wait(timeout=grace_s)
            except Exception:  # still running or already gone: make sure
                try:
                    os.killpg(popen.pid, signal.SIGKILL)
                    popen.wait(timeout=5)
                except Exception:
                    pass

    return RoleProcess


def _log_part_tail(path: pathlib.Path, start: int, end: int | None, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of `path` between byte `start` and `end` (None: its end)."""
    try:
        with open(path, "rb") as handle:
            stop = handle.seek(0, os.SEEK_END) if end is None else end
            handle.seek(max(start, stop - 65536))
            text = handle.read(max(0, stop - handle.tell())).decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _probe(address: str, timeout_s: float = 5.0) -> None:
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


def _actor_options(config: RunConfig, role: str, group: Any = None, bundle: int = 0) -> dict[str, Any]:
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


def _request(config: RunConfig, role: str) -> dict[str, float]:
    res = config.launcher.of(role)
    need = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
    if res.memory_gb:
        need["memory"] = res.memory_gb * 2**30
    return {k: v for k, v in need.items() if v}


def _check_schedulable(ray: Any, config: RunConfig, roles: list[str]) -> None:
    """A request that no alive node can hold fails now, naming the role and what it asks
    (and a `STRICT_SPREAD` role with fewer fitting nodes than processes)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for role, count in collections.Counter(roles).items():
        need = _request(config, role)
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


def _ray_specs(config: RunConfig, config_path: pathlib.Path, keys: RunKeys | None) -> list[Any]:
    """The local launcher's processes, with each role's interpreter on its own node. Each
    plan's environment carries its role's credential: Ray hands it to the actor in memory."""
    specs = []
    for spec in build_specs(config, config_path, keys):
        python = config.launcher.of(spec.role).python or PYTHON
        specs.append(dataclasses.replace(spec, argv=[python, *spec.argv[1:]]))
    return specs


def _servers(config: RunConfig) -> dict[str, str]:
    """Process name -> its address in the config, for every process others connect to (a
    multi-host trainer's process 0 hosts the gang's `jax.distributed` coordinator)."""
    return server_addresses(config)


def _address_dependents(config: RunConfig, name: str) -> list[str]:
    """The processes that must restart when `name` moves to another address: those that
    learn it only when they start. Every other client reads the address book when it
    reconnects, so a moved server restarts alone."""
    if name == "trainer0" and config.trainer.hosts > 1:  # the gang's jax.distributed coordinator
        return [f"trainer{i}" for i in range(1, config.trainer.hosts)]
    if name == "verifier" and config.agent.enabled and config.agent.where == "service":
        # The workers' environments step in the verifier service at the address they started with.
        return [f"worker{i}" for i in range(config.workers.count)]
    return []


def _accepts(address: str) -> bool:
    """Whether something listens at `address` (tcp://HOST:PORT or HOST:PORT) now."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.2):
            return True
    except (OSError, ValueError):
        return False


def _health_check_text(values: dict[str, int]) -> str:
    if not values:
        return ""
    period = values.get("health_check_period_ms", 0) / 1000
    timeout = values.get("health_check_timeout_ms", 0) / 1000
    threshold = values.get("health_check_failure_threshold", 0)
    return (
        f"period {period:g}s, timeout {timeout:g}s, threshold {threshold}: a node whose raylet died "
        f"is given up after ~{period * threshold:g}s, a vanished host after ~{(period + timeout) * threshold:g}s"
    )


def _check_health_config(config: RunConfig, cluster: dict[str, int]) -> None:
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


def _with_addresses(config: RunConfig, found: dict[str, str]) -> RunConfig:
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


class _Interrupted(Exception):
    pass


def launch(
    config_path: str | pathlib.Path | None,
    overrides: list[str] | None = None,
    *,
    overwrite: bool = False,
    console: Console | None = None,
) -> SupervisorReport:
    """Run a whole RL job as Ray actors (see the module docstring)."""
    console = console or Console()
    config = load_config(config_path, overrides)
    validate_components(resolve_addresses(config))  # placeholder addresses: the checks only
    launcher = config.launcher
    _probe(launcher.address)
    try:
        import ray  # the optional extra
    except ImportError as error:
        raise ConfigError(
            "launcher.backend=ray needs Ray on this machine: pip install 'rlax-controller[ray]'"
        ) from error

    output = config.output_dir.resolve()
    if overwrite and output.exists():
        shutil.rmtree(output)
    resumed = (output / "snapshots").is_dir()
    output.mkdir(parents=True, exist_ok=True)
    config = msgspec.structs.replace(
        config, addresses=msgspec.structs.replace(config.addresses, book=str(output / ADDRESS_BOOK))
    )
    health = launcher.health_check.system_config()
    ray.init(
        address=launcher.address or None,
        namespace=launcher.namespace,
        log_to_driver=False,
        include_dashboard=False if not launcher.address else None,
        # Only a Ray this call starts takes system settings; a cluster's are checked in place().
        **({"_system_config": health} if health and not launcher.address else {}),
    )
    run = _RayRun(ray, config, output)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(_signum: int, _frame: Any) -> None:
        raise _Interrupted("SIGTERM")

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        previous = None
    display: ProgressDisplay | None = None
    try:
        run.place()
        run.resolve()
        console.print(
            f"[bold]RLAX[/bold] run [cyan]{config.run.name}[/cyan] on Ray "
            f"({launcher.address or 'local'}, namespace {launcher.namespace}) in {output} "
            f"({'resuming' if resumed else 'new'}; {config.workers.count} workers, j={config.workers.j}, "
            f"k={config.trainer.k}, preset {config.trainer.preset}"
            + (f", trainer gang of {config.trainer.hosts}" if config.trainer.hosts > 1 else "")
            + ")"
        )
        run.start()
        display = ProgressDisplay(config.run.steps)
        report = run.supervise(_MetricsTail(output / "metrics.jsonl", display))
    except (KeyboardInterrupt, _Interrupted) as interrupt:
        report = RayReport(False, f"interrupted ({interrupt or 'Ctrl-C'})", {}, [], {}, run.log_dir)
    finally:
        if display is not None:
            display.close()
        run.teardown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summarise(console, run.config, output, report)
    return report


class _RayRun:
    """One run on Ray: its placement groups, actors, registry, plans and supervision."""

    def __init__(self, ray: Any, config: RunConfig, output: pathlib.Path) -> None:
        self.ray = ray
        self.config = config
        self.output = output
        self.log_dir = output / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.events = self.log_dir / "events.jsonl"
        self.keys = run_keys(config)  # once per run: a restarted actor presents what the others accept
        self.specs = _ray_specs(config, output / "config.yaml", self.keys)
        self.roles = {s.name: s.role for s in self.specs}
        self.actors: dict[str, Any] = {}
        self.groups: dict[str, Any] = {}
        self.registry: Any = None
        self.placement: dict[str, dict[str, Any]] = {}
        self.found: dict[str, str] = {}  # process -> the tcp:// address it was given
        self.plans: dict[str, dict[str, Any]] = {}
        self.health_check = ""  # the cluster's timing, in words (for the report)

    def event(self, kind: str, **fields: Any) -> None:
        with open(self.events, "a") as handle:
            handle.write(json.dumps({"time": time.time(), "event": kind, **fields}) + "\n")

    # ------------------------------------------------------------------ placement
    def place(self) -> None:
        """A placement group per role (one bundle per process), then one actor per process
        in its bundle; both must be placed within READY_TIMEOUT_S, or the error names the role."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray, config = self.ray, self.config
        _check_schedulable(ray, config, [s.role for s in self.specs])
        # The registry lives on the launcher's own node: it goes when the launcher goes.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.registry = (
            ray.remote(_registry_class())
            .options(num_cpus=0, max_restarts=0, scheduling_strategy=here)
            .remote()
        )
        cluster_health = ray.get(self.registry.health_check.remote(), timeout=READY_TIMEOUT_S)
        _check_health_config(config, cluster_health)
        self.health_check = _health_check_text(cluster_health)
        self.event("health_check", **cluster_health)
        members = collections.defaultdict(list)
        for spec in self.specs:
            members[spec.role].append(spec.name)
        for role, names in members.items():
            bundle = _request(config, role)
            if bundle:  # a role that asks for nothing needs no reservation
                self.groups[role] = placement_group(
                    [dict(bundle) for _ in names],
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
                    f"{_request(config, role)} ({config.launcher.of(role).placement}) was not placed "
                    f"within {READY_TIMEOUT_S:g}s (busy cluster?)"
                ) from None
        actor_class = ray.remote(_role_process_class())
        for spec in self.specs:
            group = self.groups.get(spec.role)
            bundle = members[spec.role].index(spec.name)
            self.actors[spec.name] = actor_class.options(
                name=f"{config.run.name}.{spec.name}", **_actor_options(config, spec.role, group, bundle)
            ).remote(spec.name, self.registry, spec.completes_run)
        for spec in self.specs:
            try:
                info = ray.get(
                    self.actors[spec.name].info.remote(), timeout=max(1.0, deadline - time.monotonic())
                )
            except ray.exceptions.GetTimeoutError:
                raise ConfigError(
                    f"launcher.resources.{spec.role}: {spec.name} was not placed within "
                    f"{READY_TIMEOUT_S:g}s; it asks for {_request(config, spec.role)} "
                    "(busy cluster, or a runtime_env/python that does not start)"
                ) from None
            self.placement[spec.name] = {
                "role": spec.role,
                **info,
                "request": _request(config, spec.role),
                "nodes": [info["node_id"]],
            }

    # ------------------------------------------------------------------ addresses and plans
    def resolve(self) -> None:
        """Each server binds a free port on its own node; the resolved config is written."""
        ray = self.ray
        for name, address in _servers(self.config).items():
            if address == AUTO and name in self.actors:
                self.found[name] = ray.get(self.actors[name].reserve_port.remote(), timeout=30)
        self.config = _with_addresses(self.config, self.found)
        self.replan()

    def replan(self) -> None:
        """Write the config with the current addresses and give the registry every plan (an
        actor Ray restarts reads its plan there)."""
        resolved = dump_config(self.config, self.output / "config.yaml")
        # Where every server listens now: clients read it when they reconnect.
        known = {n: a for n, a in server_addresses(self.config).items() if a != AUTO}
        write_address_book(pathlib.Path(self.config.addresses.book), known)
        self._write_placement()
        cwd = os.getcwd()
        for spec in _ray_specs(self.config, resolved, self.keys):
            address = self.found.get(spec.name, "")
            self.plans[spec.name] = {
                "argv": spec.argv,
                "env": dict(spec.env or {}),
                "cwd": spec.cwd or cwd,
                "log": str(self.log_dir / f"{spec.name}.log"),
                # The node the address belongs to: restarted elsewhere, the actor asks for a new one.
                "bind_ip": address.removeprefix("tcp://").rpartition(":")[0],
            }
            self.ray.get(self.registry.set_plan.remote(spec.name, self.plans[spec.name]), timeout=30)

    def _write_placement(self) -> None:
        (self.log_dir / "placement.json").write_text(json.dumps(self.placement, indent=1, sort_keys=True))

    def start(self) -> None:
        for spec in self.specs:  # servers first, as build_specs orders them
            pid = self.ray.get(self.actors[spec.name].start.remote(self.plans[spec.name]), timeout=60)
            self.event(
                "start", name=spec.name, role=spec.role, pid=pid, node=self.placement[spec.name]["node_id"]
            )

    # ------------------------------------------------------------------ supervision
    def supervise(self, tail: _MetricsTail) -> SupervisorReport:
        return _Supervision(self).loop(tail)

    def teardown(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL), kill every actor and remove every
        placement group we created."""
        ray = self.ray
        stops = []
        for actor in self.actors.values():
            try:
                stops.append(actor.stop.remote(_STOP_GRACE_S))
            except Exception:  # a dead actor has nothing to stop
                pass
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=_STOP_GRACE_S + 10)
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


class _Supervision:
    """The launcher's loop over the registry's snapshot: exits, restarts, gangs, moves,
    chaos, and actors Ray gave up on."""

    def __init__(self, run: _RayRun) -> None:
        self.run = run
        self.config = run.config
        self.seen_exits: dict[str, int] = {}
        self.seen_starts: dict[str, int] = {}
        self.rng = random.Random(run.config.chaos.seed)
        self.chaos_kills: list[tuple[str, str]] = []
        self.chaos_round: list[str] = []
        interval = run.config.chaos.interval
        self.next_kill = time.monotonic() + interval * self.rng.uniform(0.5, 1.5)
        self.completes = {s.name for s in run.specs if s.completes_run}
        self.gangs: dict[str, list[str]] = collections.defaultdict(list)
        for spec in run.specs:
            if spec.gang:
                self.gangs[spec.gang].append(spec.name)
        self.gang_of = {name: gang for gang, names in self.gangs.items() for name in names}
        # A gang restarts once per failure: exits of lives that began before the last restart
        # of the gang (the sequence number) are that restart's own, not new failures.
        self.gang_epoch: dict[str, int] = dict.fromkeys(self.gangs, 0)
        self.induced: collections.Counter[str] = collections.Counter()  # kills by gang restarts and moves
        self.killed_lives: set[tuple[str, int]] = set()
        self.moves_done: set[int] = set()
        self.pings: dict[str, Any] = {}
        self.dead_pings: collections.Counter[str] = collections.Counter()
        self.answered: dict[str, float] = {}  # process -> when its actor last answered a ping
        self.losses: dict[str, dict[str, Any]] = {}  # lost process -> its loss, until it serves again
        self.stalls: list[dict[str, Any]] = []
        # Planned and unplanned exits. A life the launcher ended itself (a chaos kill, a gang
        # restart, a restart for a move) -> why; a SIGKILL nobody here explains waits until
        # the process's next life shows whether its node went (it restarts on another one).
        self.planned: dict[tuple[str, int], str] = {}
        self.pending: dict[tuple[str, int], dict[str, Any]] = {}
        self.unplanned: list[UnplannedRestart] = []

    def report(
        self, success: bool, reason: str, procs: dict[str, Any], *, config_error: bool = False
    ) -> RayReport:
        self.settle_pending(procs, final=True)
        return RayReport(
            success=success,
            reason=reason,
            restarts={n: max(0, procs.get(n, {}).get("starts", 1) - 1) for n in self.run.actors},
            chaos_kills=list(self.chaos_kills),
            exit_codes={n: list(procs.get(n, {}).get("exits", [])) for n in self.run.actors},
            log_dir=self.run.log_dir,
            config_error=config_error,
            unplanned_restarts=list(self.unplanned),
            stalls=list(self.stalls),
            health_check=self.run.health_check,
        )

    def loop(self, tail: _MetricsTail) -> RayReport:
        run, ray = self.run, self.run.ray
        last_ping = 0.0
        while True:
            tail()
            snap = ray.get(run.registry.snapshot.remote(), timeout=30)
            procs: dict[str, Any] = snap["procs"]
            for name, entry in procs.items():
                ended = self.observe(name, entry, snap["seq"], procs)
                if ended is not None:
                    return ended
            self.restart_gangs(procs)
            for name, entry in procs.items():
                moved = entry.get("moved")
                if moved and moved["seq"] not in self.moves_done:
                    self.moves_done.add(moved["seq"])
                    self.move(name, moved)
            self.check_serving(procs)
            now = time.monotonic()
            self.chaos_tick(now, procs)
            if now - last_ping >= 1.0:
                last_ping = now
                dead = self.dead_actor(procs)
                if dead is not None:
                    return dead
            time.sleep(0.25)

    def observe(self, name: str, entry: dict[str, Any], seq: int, procs: dict[str, Any]) -> RayReport | None:
        run = self.run
        role = run.roles[name]
        exits = entry["exits"]
        for index in range(self.seen_exits.get(name, 0), len(exits)):
            code, life = exits[index], entry["exit_runs"][index]
            self.classify(name, entry, code, life)
            lost = next((lost for lost in entry.get("lost", []) if lost["run"] == life), None)
            if lost is not None:  # went down with its node (or its actor): Ray restarted it
                now = time.time()
                self.losses[name] = {
                    "node": lost["node_id"],
                    "lost_at": self.answered.get(name, now),
                    "detected_at": now,
                }
            gang = self.gang_of.get(name)
            if gang and life > self.gang_epoch[gang]:
                self.gang_epoch[gang] = seq
                run.event("gang_restart", gang=gang, cause=name, code=code)
        self.seen_exits[name] = len(exits)
        self.settle_pending({name: entry})
        if entry["starts"] > self.seen_starts.setdefault(name, 1):
            self.seen_starts[name] = entry["starts"]
            node = entry.get("node", {})
            run.event(
                "start", name=name, role=role, pid=node.get("pid"), node=node.get("node_id"), restart=True
            )
            nodes = run.placement[name]["nodes"]
            if node.get("node_id") and node["node_id"] != nodes[-1]:
                nodes.append(node["node_id"])
                run._write_placement()
        final, log_path = entry["final"], run.log_dir / f"{name}.log"
        if final == 0 and name in self.completes:
            return self.report(True, f"{name} completed the run", procs)
        if final == EXIT_CONFIG_ERROR:
            return self.report(
                False,
                f"{name} rejected its configuration (exit code {final}); not restarted, since the "
                f"same config would be rejected again. Last lines of {log_path}:\n{_tail(log_path)}",
                procs,
                config_error=True,
            )
        if final == EXIT_MISSING_COMPONENT:
            return self.report(
                False,
                f"{name}: its component is not installed in the {role} role's environment "
                f"(exit code {final}; launcher.resources.{role}.python="
                f"{self.config.launcher.of(role).python or '(the cluster default)'}). "
                f"Last lines of {log_path}:\n{_tail(log_path)}",
                procs,
                config_error=True,
            )
        limit = self.config.launcher.of(role).max_restarts
        by_chaos = sum(1 for n, _ in self.chaos_kills if n == name)
        failures = len(exits) - by_chaos - self.induced[name]
        if limit < 0 and failures > self.config.supervisor.max_restarts:
            return self.report(
                False,
                f"{name} exited {len(exits)} time(s) (last code {exits[-1]}), over the limit "
                f"supervisor.max_restarts={self.config.supervisor.max_restarts}. "
                f"Last lines of {log_path}:\n{_tail(log_path)}",
                procs,
            )
        return None

    def classify(self, name: str, entry: dict[str, Any], code: int, life: int) -> None:
        """Planned or unplanned, as the local supervisor tells them: a life the launcher
        ended (chaos, a gang restart, a restart for a move), the completing process's clean
        exit, a gang member that went down after another member's exit (a life older than
        the gang's last restart) and a process whose node was lost (its next life is on
        another node) are planned; anything else is unplanned. Call before the gang's
        epoch moves for this exit."""
        reason = self.planned.pop((name, life), "")
        gang = self.gang_of.get(name)
        if not reason and code == 0 and name in self.completes:
            reason = "completed the run"
        if not reason and gang and life <= self.gang_epoch[gang]:
            reason = "stopped with its gang"
        if reason:
            self.exit_event(name, code, life, planned=reason)
        elif code == LOST_EXIT:  # SIGKILLed, or gone with its actor: was it its node?
            self.pending[(name, life)] = {"code": code}
        else:
            self.exit_event(name, code, life, planned="")

    def settle_pending(self, procs: dict[str, Any], *, final: bool = False) -> None:
        """Decide each SIGKILLed life whose process has started again (or moved): on another
        node, its node was lost (planned); on the same node, something killed it (unplanned).
        `final` (the run ends): one not started again is planned if its node is gone."""
        alive: set[str] | None = None
        for (name, life), pending in list(self.pending.items()):
            entry = procs.get(name)
            if entry is None:
                continue
            nodes = {int(k): v for k, v in entry.get("life_nodes", {}).items()}
            node = nodes.get(life, "")
            later = [nodes[n] for n in sorted(nodes) if n > life]
            moved = entry.get("moved")
            if later:
                went = later[0] != node
            elif moved and moved["seq"] > life:
                went = moved.get("node_id", "") != node
            elif final:
                if alive is None:
                    try:
                        alive = {n["NodeID"] for n in self.run.ray.nodes() if n.get("Alive")}
                    except Exception:  # the cluster cannot say: call it unplanned
                        alive = set()
                went = bool(node) and node not in alive
            else:
                continue
            del self.pending[(name, life)]
            self.exit_event(name, pending["code"], life, planned="its node was lost" if went else "")

    def exit_event(self, name: str, code: int, life: int, *, planned: str) -> None:
        """The `exit` event of one life: `planned` says why, or (empty) the exit is
        unplanned and the event and the report carry the end of that life's log."""
        role = self.run.roles[name]
        if planned:
            self.run.event("exit", name=name, role=role, code=code, life=life, planned=planned)
            return
        unplanned = UnplannedRestart(name, role, code, self.life_tail(name, life))
        self.unplanned.append(unplanned)
        self.run.event(
            "exit", name=name, role=role, code=code, life=life, unplanned=True, log_tail=unplanned.log_tail
        )

    def life_tail(self, name: str, life: int) -> str:
        """The end of what life `life` of `name` wrote: as its actor read it at the exit, or
        (a life that never reported, gone with its actor) from its part of the plan's log."""
        try:
            where = self.run.ray.get(self.run.registry.life_log.remote(name, life), timeout=30)
        except Exception:  # the registry is gone: read the log from its start
            where = {"start": 0, "end": None, "tail": None}
        if where.get("tail") is not None:
            return str(where["tail"])
        plan = self.run.plans.get(name, {})
        path = pathlib.Path(plan.get("log") or self.run.log_dir / f"{name}.log")
        return _log_part_tail(path, where.get("start", 0), where.get("end"))

    def restart_gangs(self, procs: dict[str, Any]) -> None:
        """Stop every member still running a life older than its gang's last restart."""
        for gang, names in self.gangs.items():
            for name in names:
                entry = procs.get(name)
                if not entry or entry["starts"] <= len(entry["exits"]):
                    continue  # not running (restarting, or waiting for a move)
                life = entry["run"]
                if life < self.gang_epoch[gang] and (name, life) not in self.killed_lives:
                    self.killed_lives.add((name, life))
                    if self.kill(name, "stopped with its gang"):
                        self.induced[name] += 1

    def kill(self, name: str, why: str) -> int:
        """SIGKILL `name`'s component, and note the life it ended as planned (`why`). The
        life, or 0 when none runs, its actor restarting included (another process of its
        lost node: Ray is placing it again, with nothing to kill)."""
        ray = self.run.ray
        try:
            life = int(ray.get(self.run.actors[name].kill_component.remote(), timeout=30))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            return 0
        if life:
            self.planned[(name, life)] = why
        return life

    def check_serving(self, procs: dict[str, Any]) -> None:
        """Note when each lost process serves again (running, and its address accepts
        connections); once every process lost on a node does, record the node's stall."""
        run = self.run
        for name, loss in self.losses.items():
            entry = procs.get(name, {})
            if "serving_at" in loss or entry.get("starts", 0) <= len(entry.get("exits", [])):
                continue  # serving already, or not running again yet
            address = run.found.get(name, "")
            if address and not _accepts(address):
                continue
            loss["serving_at"] = time.time()
        for node in {loss["node"] for loss in self.losses.values()}:
            names = sorted(n for n, loss in self.losses.items() if loss["node"] == node)
            lost = [self.losses[n] for n in names]
            if not all("serving_at" in loss for loss in lost):
                continue
            for n in names:
                del self.losses[n]
            alive = {n["NodeID"] for n in run.ray.nodes() if n.get("Alive")}
            lost_at = min(loss["lost_at"] for loss in lost)
            record = {
                "kind": "event",
                "step": max(
                    (r["step"] for r in read_metrics(run.output / "metrics.jsonl", "train")), default=0
                ),
                "event": "process_lost" if node in alive else "node_lost",
                "node": node,
                "processes": names,
                "stall_s": round(max(loss["serving_at"] for loss in lost) - lost_at, 2),
                "detect_s": round(max(loss["detected_at"] for loss in lost) - lost_at, 2),
            }
            self.stalls.append(record)
            run.event(record["event"], **{k: v for k, v in record.items() if k not in ("kind", "event")})
            # A file of the launcher's own, as the trainer has: two hosts appending to one
            # file on shared storage (NFS) can overwrite each other's lines.
            append_line(run.output / LAUNCHER_METRICS, json.dumps({"time": time.time(), **record}))

    def move(self, name: str, moved: dict[str, Any]) -> None:
        """`name` restarted on another node (its node was lost): give it an address there,
        rewrite the config and the address book, and start it. Its clients find it there
        through the book; only the processes that learn its address at start alone
        (`_address_dependents`) are restarted."""
        run, ray = self.run, self.run.ray
        # The actor told the registry from its constructor: until that returns, Ray still
        # calls it restarting and refuses calls (ActorUnavailableError).
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                address = ray.get(run.actors[name].reserve_port.remote(), timeout=30)
                break
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        old = run.found.get(name, "")
        run.found[name] = address
        run.config = _with_addresses(run.config, run.found)
        run.placement[name]["nodes"].append(moved["node_id"])
        run.replan()
        run.event("moved", name=name, node=moved["node_id"], old=old, address=address)
        ray.get(run.actors[name].start.remote(run.plans[name]), timeout=60)
        dependents = _address_dependents(self.config, name)
        for other in dependents:
            if self.kill(other, f"restarted because {name} moved"):
                self.induced[other] += 1
                run.event("restart_for_move", name=other, moved=name)
        if dependents:
            snap_seq = ray.get(run.registry.snapshot.remote(), timeout=30)["seq"]
            for gang in {self.gang_of[n] for n in dependents if n in self.gang_of}:
                self.gang_epoch[gang] = snap_seq  # those kills are this move's, not a gang failure

    def chaos_tick(self, now: float, procs: dict[str, Any]) -> None:
        """The local supervisor's chaos mode: SIGKILL a component (its actor then restarts)."""
        chaos, run = self.config.chaos, self.run
        if (
            chaos.interval <= 0
            or now < self.next_kill
            or (chaos.max_kills and len(self.chaos_kills) >= chaos.max_kills)
        ):
            return
        targets = sorted({r for r in run.roles.values() if r in chaos.targets})
        if not targets:
            return
        if not self.chaos_round:
            self.chaos_round.extend(self.rng.sample(targets, len(targets)))
        running = [
            n
            for n, r in run.roles.items()
            if r == self.chaos_round[0]
            and procs.get(n, {}).get("starts", 0) > len(procs.get(n, {}).get("exits", []))
        ]
        if not running:
            return  # restarting: try again at the next tick
        role = self.chaos_round.pop(0)
        victim = self.rng.choice(running)
        run.event("chaos_kill", name=victim, role=role)
        self.kill(victim, "chaos kill")
        self.chaos_kills.append((victim, role))
        self.next_kill = now + chaos.interval * self.rng.uniform(0.5, 1.5)

    def dead_actor(self, procs: dict[str, Any]) -> RayReport | None:
        """An actor Ray will not restart (`ActorDiedError` twice in a row, a second apart;
        a restarting one answers `ActorUnavailableError` or waits) ends the run."""
        run, ray = self.run, self.run.ray
        done: set[str] = set()
        if self.pings:
            ready, _ = ray.wait(list(self.pings.values()), num_returns=len(self.pings), timeout=0)
            done = {ref.hex() for ref in ready}
        for name, ref in list(self.pings.items()):
            if ref.hex() not in done:
                continue
            del self.pings[name]
            try:
                ray.get(ref)
                self.dead_pings[name] = 0
                self.answered[name] = time.time()
            except ray.exceptions.ActorUnavailableError:
                self.dead_pings[name] = 0
            except ray.exceptions.ActorDiedError as error:
                self.dead_pings[name] += 1
                if self.dead_pings[name] >= 2:
                    role, log_path = run.roles[name], run.log_dir / f"{name}.log"
                    return self.report(
                        False,
                        f"{name} died and Ray will not restart it (restarted "
                        f"{max(0, procs.get(name, {}).get('starts', 1) - 1)} time(s); "
                        f"launcher.resources.{role}.max_restarts="
                        f"{self.config.launcher.of(role).max_restarts}): {str(error)[:300]}. "
                        f"Last lines of {log_path}:\n{_tail(log_path)}",
                        procs,
                    )
        for name, actor in run.actors.items():
            if name not in self.pings:
                self.pings[name] = actor.info.remote()
        return None
