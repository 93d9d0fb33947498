"""`rlax launch` with `launcher.backend: ray`: every component as a Ray actor on a cluster.

- Connects with `ray.init(address=launcher.address, namespace=launcher.namespace)` (an
  empty address starts a local Ray); an unreachable address fails within seconds (a TCP
  probe of HOST:PORT first), naming it.
- One `RoleProcess` actor per process of the local launcher (`build_specs`), placed with
  its role's `launcher.resources` (CPUs, GPUs, memory, custom resources), restarted by Ray
  up to the role's `max_restarts`, and run by the role's own interpreter
  (`runtime_env.py_executable`) when `python` is set. A request no alive node can hold
  fails at once, naming the role and the resources; one that stays unscheduled fails after
  `READY_TIMEOUT_S`.
- Addresses are discovered through Ray: every server actor reports `tcp://<its node IP>:
  <a free port there>`, the launcher writes the resolved config into the run folder, and
  only then is each actor told to start its component (the same command line as the local
  launcher). The plan of every process (command, address) lives in a small registry actor:
  an actor that Ray restarts reads it back in its constructor and restarts the component on
  the SAME address, which the other components already know.
- A component that exits non-zero makes its actor exit, so Ray restarts the actor; exit 78
  (config rejected) or 69 (component not installed in the role's environment) stop the
  run with the component's message; so does an actor that Ray gave up on (its
  `max_restarts`) or, with `max_restarts: -1`, more than `supervisor.max_restarts`
  restarts of one process.
- Logs: each actor appends its component's output to `<run>/logs/<process>.log`; the run
  folder must be shared storage visible to every node at the same path (it is, for the
  checkpoints, snapshots and metrics, anyway). Where each process ran is written to
  `<run>/logs/placement.json`, and every start, exit and chaos kill to `events.jsonl`.
- `chaos.*` works as in the local launcher: a seeded random component is SIGKILLed every
  ~`chaos.interval` seconds (through its actor), and Ray restarts its actor.
- The progress display, summary table and plot are the local launcher's; at the end, on
  an error or Ctrl-C every actor the launcher created is stopped (component SIGTERM, then
  SIGKILL) and killed, so nothing is left running on the cluster.

Ray is imported only here, and only when this backend runs (`pip install
rlax-controller[ray]`); the rest of the controller never needs it.
"""

from __future__ import annotations

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

from rlax_controller.launcher import _MetricsTail, build_specs, resolve_addresses, summarise
from rlax_controller.metrics import ProgressDisplay
from rlax_controller.preflight import validate_components
from rlax_controller.supervisor import SupervisorReport
from rlax_core.config import AUTO, EXIT_CONFIG_ERROR, ConfigError, RunConfig, dump_config, load_config

__all__ = ["READY_TIMEOUT_S", "launch"]

EXIT_MISSING_COMPONENT = 69  # rlax_core.cli: the role's package is not installed in its environment
READY_TIMEOUT_S = 45.0
PYTHON = "{python}"  # in a command: the interpreter of the actor that runs it
_STOP_GRACE_S = 5.0


def _registry_class() -> type:
    """The plan of every process and what happened to it, kept by one small actor."""

    class Registry:
        def __init__(self) -> None:
            self.plans: dict[str, dict[str, Any]] = {}
            self.state: dict[str, dict[str, Any]] = {}

        def set_plan(self, name: str, plan: dict[str, Any]) -> None:
            self.plans[name] = plan

        def plan(self, name: str) -> dict[str, Any] | None:
            return self.plans.get(name)

        def started(self, name: str, node: dict[str, Any]) -> None:
            entry = self.state.setdefault(name, {"starts": 0, "exits": [], "final": None})
            entry["starts"] += 1
            entry["node"] = node

        def exited(self, name: str, code: int, final: bool) -> None:
            entry = self.state.setdefault(name, {"starts": 0, "exits": [], "final": None})
            entry["exits"].append(code)
            if final:
                entry["final"] = code

        def snapshot(self) -> dict[str, dict[str, Any]]:
            return self.state

    return Registry


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
            plan = ray.get(registry.plan.remote(name))
            if plan is not None:  # restarted by Ray: the component again, on its known address
                self.start(plan)

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

            with self.lock, open(log_path, "ab") as log:
                log.write(f"--- {self.name} starting on {self.node} ---\n".encode())
                log.flush()
                self.popen = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, preexec_fn=die_with_parent
                )
            ray.get(self.registry.started.remote(self.name, {**self.node, "pid": self.popen.pid}))
            threading.Thread(target=self._watch, args=(self.popen,), daemon=True).start()
            return int(self.popen.pid)

        def _watch(self, popen: Any) -> None:
            import ray

            code = popen.wait()
            if popen is not self.popen:
                return
            final = (code == 0 and self.completes_run) or code in (78, EXIT_MISSING_COMPONENT)
            try:
                ray.get(self.registry.exited.remote(self.name, code, final))
            except Exception:  # the launcher is going away: nothing to tell
                pass
            if not final:
                os._exit(1)  # the actor dies with its component: Ray restarts it (max_restarts)

        def pid(self) -> int:
            return -1 if self.popen is None else int(self.popen.pid)

        def kill_component(self) -> None:
            """Chaos: SIGKILL the component's process group (the actor then restarts)."""
            if self.popen is not None and self.popen.poll() is None:
                os.killpg(self.popen.pid, signal.SIGKILL)

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


def _actor_options(config: RunConfig, role: str) -> dict[str, Any]:
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
    return options


def _request(config: RunConfig, role: str) -> dict[str, float]:
    res = config.launcher.of(role)
    need = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
    if res.memory_gb:
        need["memory"] = res.memory_gb * 2**30
    return {k: v for k, v in need.items() if v}


def _check_schedulable(ray: Any, config: RunConfig, roles: list[str]) -> None:
    """A request that no alive node can hold fails now, naming the role and what it asks."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for role in dict.fromkeys(roles):
        need = _request(config, role)
        if any(all(n["Resources"].get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
            continue
        have = "; ".join(
            f"{n['NodeManagerAddress']} {n['NodeID'][:8]}: "
            + ", ".join(f"{k}={v:g}" for k, v in sorted(n["Resources"].items()) if "node:" not in k)
            for n in nodes
        )
        raise ConfigError(
            f"launcher.resources.{role}: no node of the Ray cluster has {need} "
            f"(nodes: {have or 'none alive'})"
        )


def _ray_specs(config: RunConfig, config_path: pathlib.Path) -> list[Any]:
    """The local launcher's processes, with each role's interpreter on its own node."""
    specs = []
    for spec in build_specs(config, config_path):
        python = config.launcher.of(spec.role).python or PYTHON
        specs.append(dataclasses.replace(spec, argv=[python, *spec.argv[1:]]))
    return specs


def _with_addresses(config: RunConfig, found: dict[str, str]) -> RunConfig:
    workers = list(config.workers.addresses) or [AUTO] * config.workers.count
    return msgspec.structs.replace(
        config,
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


def _tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


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
    log_dir = output / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    events = log_dir / "events.jsonl"

    def event(kind: str, **fields: Any) -> None:
        with open(events, "a") as handle:
            handle.write(json.dumps({"time": time.time(), "event": kind, **fields}) + "\n")

    ray.init(
        address=launcher.address or None,
        namespace=launcher.namespace,
        log_to_driver=False,
        include_dashboard=False if not launcher.address else None,
    )
    actors: dict[str, Any] = {}
    registry: Any = None
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(_signum: int, _frame: Any) -> None:
        raise _Interrupted("SIGTERM")

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        previous = None
    display: ProgressDisplay | None = None
    try:
        placeholder = output / "config.yaml"
        specs = _ray_specs(config, placeholder)
        _check_schedulable(ray, config, [s.role for s in specs])
        registry = ray.remote(_registry_class()).options(num_cpus=0, max_restarts=0).remote()
        actor_class = ray.remote(_role_process_class())
        for spec in specs:
            actors[spec.name] = actor_class.options(
                name=f"{config.run.name}.{spec.name}", **_actor_options(config, spec.role)
            ).remote(spec.name, registry, spec.completes_run)
        # Ready: every actor placed (a timeout names what could not be scheduled).
        placement: dict[str, Any] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        for spec in specs:
            try:
                info = ray.get(actors[spec.name].info.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise ConfigError(
                    f"launcher.resources.{spec.role}: {spec.name} was not placed within "
                    f"{READY_TIMEOUT_S:g}s; it asks for {_request(config, spec.role)} "
                    "(busy cluster, or a runtime_env/python that does not start)"
                ) from None
            placement[spec.name] = {"role": spec.role, **info, "request": _request(config, spec.role)}
        # Addresses: each server binds a free port on its own node.
        servers = ["paramserver", "controller", *(f"worker{i}" for i in range(config.workers.count))]
        if config.verifier.mode == "service":
            servers.append("verifier")
        wanted = {
            "paramserver": config.paramserver.address,
            "controller": config.controller.address,
            "verifier": config.verifier.address,
            **{
                f"worker{i}": a
                for i, a in enumerate(list(config.workers.addresses) or [AUTO] * config.workers.count)
            },
        }
        found = {
            name: ray.get(actors[name].reserve_port.remote())
            for name in servers
            if name in actors and wanted.get(name) == AUTO
        }
        config = _with_addresses(config, found)
        resolved = dump_config(config, output / "config.yaml")
        (log_dir / "placement.json").write_text(json.dumps(placement, indent=1, sort_keys=True))
        console.print(
            f"[bold]RLAX[/bold] run [cyan]{config.run.name}[/cyan] on Ray "
            f"({launcher.address or 'local'}, namespace {launcher.namespace}) in {output} "
            f"({'resuming' if resumed else 'new'}; {config.workers.count} workers, j={config.workers.j}, "
            f"k={config.trainer.k}, preset {config.trainer.preset})"
        )
        specs = _ray_specs(config, resolved)
        cwd = os.getcwd()
        plans = {
            spec.name: {
                "argv": spec.argv,
                "env": dict(spec.env or {}),
                "cwd": spec.cwd or cwd,
                "log": str(log_dir / f"{spec.name}.log"),
            }
            for spec in specs
        }
        for name, plan in plans.items():  # kept by the registry for an actor Ray restarts
            ray.get(registry.set_plan.remote(name, plan))
        for spec in specs:  # servers first, as build_specs orders them
            pid = ray.get(actors[spec.name].start.remote(plans[spec.name]))
            event("start", name=spec.name, role=spec.role, pid=pid, node=placement[spec.name]["node_id"])

        display = ProgressDisplay(config.run.steps)
        tail = _MetricsTail(output / "metrics.jsonl", display)
        report = _supervise(ray, config, specs, actors, registry, log_dir, tail, event)
    except (KeyboardInterrupt, _Interrupted) as interrupt:
        report = SupervisorReport(False, f"interrupted ({interrupt or 'Ctrl-C'})", {}, [], {}, log_dir)
    finally:
        if display is not None:
            display.close()
        _teardown(ray, actors, registry)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summarise(console, config, output, report)
    return report


def _supervise(
    ray: Any,
    config: RunConfig,
    specs: list[Any],
    actors: dict[str, Any],
    registry: Any,
    log_dir: pathlib.Path,
    tail: _MetricsTail,
    event: Any,
) -> SupervisorReport:
    from ray._private.state import state as gcs_state

    roles = {s.name: s.role for s in specs}
    completes = {s.name for s in specs if s.completes_run}
    seen_exits: dict[str, int] = {}
    seen_starts: dict[str, int] = {}
    chaos = config.chaos
    rng = random.Random(chaos.seed)
    chaos_kills: list[tuple[str, str]] = []
    chaos_round: list[str] = []
    next_kill = time.monotonic() + chaos.interval * rng.uniform(0.5, 1.5)

    def chaos_tick(now: float, snap: dict[str, Any]) -> None:
        """The local supervisor's chaos mode: SIGKILL a component (its actor then restarts)."""
        nonlocal next_kill
        if (
            chaos.interval <= 0
            or now < next_kill
            or (chaos.max_kills and len(chaos_kills) >= chaos.max_kills)
        ):
            return
        targets = sorted({r for r in roles.values() if r in chaos.targets})
        if not targets:
            return
        if not chaos_round:
            chaos_round.extend(rng.sample(targets, len(targets)))
        running = [
            n
            for n, r in roles.items()
            if r == chaos_round[0]
            and snap.get(n, {}).get("starts", 0) > len(snap.get(n, {}).get("exits", []))
        ]
        if not running:
            return  # restarting: try again at the next tick
        role = chaos_round.pop(0)
        victim = rng.choice(running)
        event("chaos_kill", name=victim, role=role)
        ray.get(actors[victim].kill_component.remote(), timeout=30)
        chaos_kills.append((victim, role))
        next_kill = now + chaos.interval * rng.uniform(0.5, 1.5)

    def report(
        success: bool, reason: str, snap: dict[str, Any], *, config_error: bool = False
    ) -> SupervisorReport:
        return SupervisorReport(
            success=success,
            reason=reason,
            restarts={n: max(0, snap.get(n, {}).get("starts", 1) - 1) for n in actors},
            chaos_kills=list(chaos_kills),
            exit_codes={n: list(snap.get(n, {}).get("exits", [])) for n in actors},
            log_dir=log_dir,
            config_error=config_error,
        )

    last_state_check = 0.0
    while True:
        tail()
        snap: dict[str, Any] = ray.get(registry.snapshot.remote(), timeout=30)
        for name, entry in snap.items():
            exits = entry["exits"]
            for code in exits[seen_exits.get(name, 0) :]:
                event("exit", name=name, role=roles[name], code=code)
            seen_exits[name] = len(exits)
            if entry["starts"] > seen_starts.setdefault(name, 1):
                seen_starts[name] = entry["starts"]
                node = entry.get("node", {})
                event(
                    "start",
                    name=name,
                    role=roles[name],
                    pid=node.get("pid"),
                    node=node.get("node_id"),
                    restart=True,
                )
            final, log_path = entry["final"], log_dir / f"{name}.log"
            if final == 0 and name in completes:
                return report(True, f"{name} completed the run", snap)
            if final == EXIT_CONFIG_ERROR:
                return report(
                    False,
                    f"{name} rejected its configuration (exit code {final}); not restarted, since the "
                    f"same config would be rejected again. Last lines of {log_path}:\n{_tail(log_path)}",
                    snap,
                    config_error=True,
                )
            if final == EXIT_MISSING_COMPONENT:
                return report(
                    False,
                    f"{name}: its component is not installed in the {roles[name]} role's environment "
                    f"(exit code {final}; launcher.resources.{roles[name]}.python="
                    f"{config.launcher.of(roles[name]).python or '(the cluster default)'}). "
                    f"Last lines of {log_path}:\n{_tail(log_path)}",
                    snap,
                    config_error=True,
                )
            limit = config.launcher.of(roles[name]).max_restarts
            by_chaos = sum(1 for n, _ in chaos_kills if n == name)
            if limit < 0 and len(exits) - by_chaos > config.supervisor.max_restarts:
                return report(
                    False,
                    f"{name} exited {len(exits)} time(s) (last code {exits[-1]}), over the limit "
                    f"supervisor.max_restarts={config.supervisor.max_restarts}. "
                    f"Last lines of {log_path}:\n{_tail(log_path)}",
                    snap,
                )
        now = time.monotonic()
        chaos_tick(now, snap)
        if now - last_state_check >= 1.0:
            last_state_check = now
            for name, actor in actors.items():
                row = gcs_state.actor_table(actor._actor_id.hex())
                if row and row.get("State") == "DEAD":
                    log_path = log_dir / f"{name}.log"
                    restarts = row.get("NumRestarts", 0)
                    return report(
                        False,
                        f"{name} died and Ray will not restart it (restarted {restarts} time(s); "
                        f"launcher.resources.{roles[name]}.max_restarts="
                        f"{config.launcher.of(roles[name]).max_restarts}): "
                        f"{(row.get('DeathCause') or {})!s:.300}. Last lines of {log_path}:\n{_tail(log_path)}",
                        snap,
                    )
        time.sleep(0.25)


def _teardown(ray: Any, actors: dict[str, Any], registry: Any) -> None:
    """Stop every component (SIGTERM, then SIGKILL) and kill every actor we created."""
    stops = []
    for actor in actors.values():
        try:
            stops.append(actor.stop.remote(_STOP_GRACE_S))
        except Exception:  # a dead actor has nothing to stop
            pass
    if stops:
        ray.wait(stops, num_returns=len(stops), timeout=_STOP_GRACE_S + 10)
    for actor in [*actors.values(), *([registry] if registry is not None else [])]:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
    ray.shutdown()
