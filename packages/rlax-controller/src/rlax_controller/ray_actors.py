"""The Ray backend's two actors: the registry, which keeps the plan of every process and
what happened to it, and `RoleProcess`, which runs one component.

Both are built in a function so that Ray ships them by value: the node of a `RoleProcess`
needs ray and the role's package, not rlax-controller, and the registry (on the launcher's
node, the head's with Ray Client) needs nothing else either. For the same reason the
registry's records are stdlib dataclasses defined in the function, and what crosses to
the launcher is plain data (`Registry.snapshot`, `Registry.life_log`), which the launcher
reads as the typed records of `ray_records`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
from typing import Any

from rlax_controller.ray_records import LOST_EXIT, PYTHON
from rlax_controller.restart_policy import NEVER_RESTARTED, UNPLANNED_TAIL_LINES
from rlax_protocol.ports import reserve_port

__all__ = ["LOST_EXIT", "registry_class", "role_process_class"]

# How far back from a log's end a life's tail is read on its node.
_TAIL_WINDOW_BYTES = 65536


def registry_class() -> type:
    """The plan of every process and what happened to it, kept by one small actor. Every
    start, exit and move takes the next number of one sequence, so the launcher can tell
    which life of a process an exit belongs to (a gang restarts once per failure)."""

    @dataclasses.dataclass
    class Node:
        """Where a life ran (as its actor tells it)."""

        node_id: str = ""
        node_ip: str = ""
        hostname: str = ""
        actor_pid: int = 0
        pid: int = 0

    @dataclasses.dataclass
    class Moved(Node):
        """The node a server restarted on, away from its address; `seq`: when."""

        seq: int = 0

    @dataclasses.dataclass
    class LostLife:
        """A life that went down with its node (or its actor) without reporting an exit."""

        run: int
        node_id: str

    @dataclasses.dataclass
    class Record:
        """One process: its lives (`run`: the current one's number) and their exits."""

        starts: int = 0
        exits: list[int] = dataclasses.field(default_factory=list)
        exit_runs: list[int] = dataclasses.field(default_factory=list)
        final: int | None = None
        run: int = 0
        node: Node = dataclasses.field(default_factory=Node)
        life_nodes: dict[int, str] = dataclasses.field(default_factory=dict)
        lost: list[LostLife] = dataclasses.field(default_factory=list)
        moved: Moved | None = None

        def wire(self) -> dict[str, Any]:
            # A process with no lost life and no pending move says nothing of either.
            data = dataclasses.asdict(self)
            if not self.lost:
                del data["lost"]
            if self.moved is None:
                del data["moved"]
            return data

    def node_of(fields: dict[str, Any]) -> Node:
        known = {f.name for f in dataclasses.fields(Node)}
        return Node(**{k: v for k, v in fields.items() if k in known})

    class Registry:
        def __init__(self) -> None:
            self.plans: dict[str, dict[str, Any]] = {}
            self.records: dict[str, Record] = {}
            self.seq = 0
            # Kept out of the snapshot (read only for an unplanned exit): where each life's
            # output starts in its log, and the end of each life's log as its actor read it
            # at the exit.
            self.log_starts: dict[str, list[tuple[int, int]]] = {}
            self.tails: dict[tuple[str, int], str] = {}

        def _record(self, name: str) -> Record:
            return self.records.setdefault(name, Record())

        def set_plan(self, name: str, plan: dict[str, Any]) -> None:
            self.plans[name] = plan

        def plan(self, name: str) -> dict[str, Any] | None:
            return self.plans.get(name)

        def _close_lost_life(self, record: Record) -> None:
            # A life that never reported its exit went down with its node (or its actor).
            if record.starts > len(record.exits):
                self.seq += 1
                record.exits.append(LOST_EXIT)
                record.exit_runs.append(record.run)
                # Told apart from a SIGKILLed component's own exit (-9 as well): the node it was on.
                record.lost.append(LostLife(record.run, record.node.node_id))

        def started(self, name: str, node: dict[str, Any], log_offset: int = 0) -> int:
            record = self._record(name)
            self._close_lost_life(record)
            self.seq += 1
            record.starts += 1
            record.node = node_of(node)
            record.run = self.seq
            # The node of every life: an exit followed by a life on another node went down with its node.
            record.life_nodes[self.seq] = record.node.node_id
            record.moved = None
            self.log_starts.setdefault(name, []).append((self.seq, log_offset))
            return self.seq

        def exited(self, name: str, code: int, final: bool, run: int, log_tail: str = "") -> None:
            self.seq += 1
            record = self._record(name)
            record.exits.append(code)
            record.exit_runs.append(run)
            if final:
                record.final = code
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
            record = self._record(name)
            self._close_lost_life(record)
            self.seq += 1
            record.moved = Moved(**dataclasses.asdict(node_of(node)), seq=self.seq)

        def snapshot(self) -> dict[str, Any]:
            return {"seq": self.seq, "procs": {name: r.wire() for name, r in self.records.items()}}

        def health_check(self) -> dict[str, int]:
            """The cluster's health-check settings, as this actor's process got them."""
            try:
                # ray's _raylet.pyi stub declares only part of the compiled module; Config is there.
                from ray._raylet import Config  # type: ignore[attr-defined]
            except ImportError:
                return {}
            names = ("health_check_period_ms", "health_check_timeout_ms", "health_check_failure_threshold")
            return {name: int(getattr(Config, name)()) for name in names if hasattr(Config, name)}

    return Registry


def role_process_class() -> type:
    """The actor that runs one component (see the module docstring)."""

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
            return f"tcp://{self.node['node_ip']}:{reserve_port(self.node['node_ip'])}"

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
            # restart_policy: the completing clean exit and the codes a restart would repeat are final.
            final = (code == 0 and self.completes_run) or code in NEVER_RESTARTED
            tail = ""
            try:  # the end of what this life wrote (a crash's traceback), read on its own node
                with open(log_path, "rb") as log:
                    end = log.seek(0, os.SEEK_END)
                    log.seek(max(offset, end - _TAIL_WINDOW_BYTES))
                    tail = "\n".join(log.read().decode(errors="replace").splitlines()[-UNPLANNED_TAIL_LINES:])
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
