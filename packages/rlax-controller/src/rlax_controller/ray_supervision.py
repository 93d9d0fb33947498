"""The Ray backend's supervision: the launcher's loop over the registry's snapshot.

Exits and restarts follow `restart_policy` (Ray restarts the actors; the policy says which
exits stop the run and how many failures are too many), trainer gangs restart together,
servers whose node was lost move, chaos kills come from `chaos.ChaosSchedule`, actors Ray
gave up on end the run, and each lost node's stall is measured (`NodeLosses`).

Planned and unplanned exits, as the local supervisor tells them: an exit is planned when
the launcher ended that life itself (a chaos kill, a gang restart, a restart for a move),
when it is the completing process's clean exit, a gang member going down after another
member's exit, or a life that went down with its node (its next life is on another node,
or it moved). Anything else is unplanned: its `exit` event says `unplanned: true` and
carries the end of that life's log. A SIGKILL nobody here explains waits for the
process's next life (or the run's end: is its node still alive?) to be told.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any, Protocol

from rlax_controller.chaos import ChaosSchedule
from rlax_controller.metrics import read_metrics
from rlax_controller.process_plan import ProcessSpec
from rlax_controller.ray_records import LOST_EXIT, LifeLog, ProcessRecord, processes
from rlax_controller.restart_policy import ExitVerdict, RestartPolicy, log_part_tail, log_tail
from rlax_controller.run_report import RayReport, UnplannedRestart
from rlax_core.config import RunConfig
from rlax_core.fsutil import append_line

__all__ = ["LAUNCHER_METRICS", "NodeLosses", "RaySupervision", "RunOnRay", "accepts"]

LAUNCHER_METRICS = "launcher_metrics.jsonl"  # the launcher's metrics records (node losses)
_PROBE_TIMEOUT_S = 0.2  # a listening server answers a local connect at once
_CALL_TIMEOUT_S = 30.0


class RunOnRay(Protocol):
    """What the supervision needs of the run (`ray_backend.RayRun`)."""

    ray: Any
    config: RunConfig
    output: Any
    log_dir: Any
    specs: list[ProcessSpec]
    roles: dict[str, str]
    registry: Any
    actors: dict[str, Any]
    placement: dict[str, dict[str, Any]]
    found: dict[str, str]
    health_check: str

    def event(self, kind: str, **fields: Any) -> None: ...

    def write_placement(self) -> None: ...

    def move(self, name: str, node_id: str) -> list[str]: ...


def accepts(address: str) -> bool:
    """Whether something listens at `address` (tcp://HOST:PORT or HOST:PORT) now."""
    import socket

    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


@dataclasses.dataclass
class _Loss:
    """A process lost with its node (or its actor), until its replacement serves."""

    node: str
    lost_at: float  # its actor's last answer
    detected_at: float  # when the registry showed the loss
    serving_at: float | None = None


class NodeLosses:
    """The stall of every lost node: from the last answer of its processes' actors to every
    replacement serving (its address accepts connections; a process that is no server:
    started), recorded in events.jsonl, the launcher's metrics file and the report."""

    def __init__(self, run: RunOnRay) -> None:
        self.run = run
        self.answered: dict[str, float] = {}  # process -> when its actor last answered a ping
        self.losses: dict[str, _Loss] = {}
        self.stalls: list[dict[str, Any]] = []

    def lost(self, name: str, node_id: str) -> None:
        now = time.time()
        self.losses[name] = _Loss(node_id, self.answered.get(name, now), now)

    def check_serving(self, procs: Mapping[str, ProcessRecord]) -> None:
        """Note when each lost process serves again; once every process lost on a node
        does, record the node's stall."""
        run = self.run
        for name, loss in self.losses.items():
            record = procs.get(name, ProcessRecord())
            if loss.serving_at is not None or not record.running:
                continue  # serving already, or not running again yet
            address = run.found.get(name, "")
            if address and not accepts(address):
                continue
            loss.serving_at = time.time()
        for node in {loss.node for loss in self.losses.values()}:
            names = sorted(n for n, loss in self.losses.items() if loss.node == node)
            lost = [self.losses[n] for n in names]
            serving = [loss.serving_at for loss in lost if loss.serving_at is not None]
            if len(serving) < len(lost):
                continue
            for n in names:
                del self.losses[n]
            alive = {n["NodeID"] for n in run.ray.nodes() if n.get("Alive")}
            lost_at = min(loss.lost_at for loss in lost)
            steps = read_metrics(run.output / "metrics.jsonl", "train")
            event = "process_lost" if node in alive else "node_lost"
            stall = {
                "kind": "event",
                "step": max((r["step"] for r in steps), default=0),
                "event": event,
                "node": node,
                "processes": names,
                "stall_s": round(max(serving) - lost_at, 2),
                "detect_s": round(max(loss.detected_at for loss in lost) - lost_at, 2),
            }
            self.stalls.append(stall)
            run.event(event, **{k: v for k, v in stall.items() if k not in ("kind", "event")})
            # A file of the launcher's own, as the trainer has: two hosts appending to one
            # file on shared storage (NFS) can overwrite each other's lines.
            append_line(run.output / LAUNCHER_METRICS, json.dumps({"time": time.time(), **stall}))


class RaySupervision:
    """Exits, restarts, gangs, moves, chaos, and actors Ray gave up on (module docstring).
    `observe`, `chaos_tick` and `report` take a snapshot's processes as the registry sends
    them (plain data)."""

    def __init__(self, run: RunOnRay) -> None:
        self.run = run
        self.config = run.config
        self.restart = RestartPolicy(run.config.supervisor)
        self.seen_exits: dict[str, int] = {}
        self.seen_starts: dict[str, int] = {}
        self.chaos = ChaosSchedule(run.config.chaos)
        self.chaos.schedule(time.monotonic())
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
        self.losses = NodeLosses(run)
        # A life the launcher ended itself (a chaos kill, a gang restart, a restart for a
        # move) -> why; a SIGKILLed life nobody here explains -> its exit code, until told.
        self.planned: dict[tuple[str, int], str] = {}
        self.pending: dict[tuple[str, int], int] = {}
        self.unplanned: list[UnplannedRestart] = []

    @property
    def chaos_kills(self) -> list[tuple[str, str]]:
        return self.chaos.kills

    @property
    def next_kill(self) -> float:
        return self.chaos.next_kill

    @next_kill.setter
    def next_kill(self, moment: float) -> None:
        self.chaos.next_kill = moment

    def report(
        self, success: bool, reason: str, procs: Mapping[str, Any], *, config_error: bool = False
    ) -> RayReport:
        records = processes(procs)
        self.settle_pending(records, final=True)
        return RayReport(
            success=success,
            reason=reason,
            restarts={n: max(0, records.get(n, ProcessRecord(starts=1)).starts - 1) for n in self.run.actors},
            chaos_kills=list(self.chaos.kills),
            exit_codes={n: list(records.get(n, ProcessRecord()).exits) for n in self.run.actors},
            log_dir=self.run.log_dir,
            config_error=config_error,
            unplanned_restarts=list(self.unplanned),
            stalls=list(self.losses.stalls),
            health_check=self.run.health_check,
        )

    def loop(self, on_tick: Any) -> RayReport:
        run, ray = self.run, self.run.ray
        last_ping = 0.0
        while True:
            on_tick()
            snap = ray.get(run.registry.snapshot.remote(), timeout=_CALL_TIMEOUT_S)
            procs: dict[str, Any] = snap["procs"]
            for name, entry in procs.items():
                ended = self.observe(name, entry, snap["seq"], procs)
                if ended is not None:
                    return ended
            records = processes(procs)
            self.restart_gangs(records)
            for name, record in records.items():
                if record.moved is not None and record.moved.seq not in self.moves_done:
                    self.moves_done.add(record.moved.seq)
                    self.move(name, record.moved.node_id)
            self.losses.check_serving(records)
            now = time.monotonic()
            self.chaos_tick(now, procs)
            if now - last_ping >= 1.0:
                last_ping = now
                dead = self.dead_actor(procs)
                if dead is not None:
                    return dead
            time.sleep(0.25)

    def observe(self, name: str, entry: Any, seq: int, procs: Mapping[str, Any]) -> RayReport | None:
        """Take in what happened to `name` since the last snapshot; a report ends the run."""
        run = self.run
        records = processes(procs)
        record = records[name]
        role = run.roles[name]
        for index in range(self.seen_exits.get(name, 0), len(record.exits)):
            code, life = record.exits[index], record.exit_runs[index]
            self.classify(name, code, life)
            lost = next((lost for lost in record.lost if lost.run == life), None)
            if lost is not None:  # went down with its node (or its actor): Ray restarted it
                self.losses.lost(name, lost.node_id)
            gang = self.gang_of.get(name)
            if gang and life > self.gang_epoch[gang]:
                self.gang_epoch[gang] = seq
                run.event("gang_restart", gang=gang, cause=name, code=code)
        self.seen_exits[name] = len(record.exits)
        self.settle_pending({name: record})
        if record.starts > self.seen_starts.setdefault(name, 1):
            self.seen_starts[name] = record.starts
            node = record.node
            run.event(
                "start", name=name, role=role, pid=node.pid or None, node=node.node_id or None, restart=True
            )
            nodes = run.placement[name]["nodes"]
            if node.node_id and node.node_id != nodes[-1]:
                nodes.append(node.node_id)
                run.write_placement()
        log_path = run.log_dir / f"{name}.log"
        if record.final is not None:
            verdict = self.restart.verdict(record.final, completes_run=name in self.completes)
            if verdict is ExitVerdict.COMPLETED:
                return self.report(True, f"{name} completed the run", procs)
            if verdict is not ExitVerdict.RESTART:
                python = self.config.launcher.of(role).python or "(the cluster default)"
                setting = f"launcher.resources.{role}.python={python}"
                reason = self.restart.stop_reason(verdict, name, record.final, log_path, setting)
                return self.report(False, reason, procs, config_error=True)
        failures = len(record.exits) - self.chaos.kills_of(name) - self.induced[name]
        # Ray restarts the actor up to the role's max_restarts; -1 leaves the budget to us.
        if self.config.launcher.of(role).max_restarts < 0 and self.restart.over_budget(failures):
            what = f"{name} exited {len(record.exits)} time(s) (last code {record.exits[-1]})"
            return self.report(False, self.restart.budget_reason(what, log_path), procs)
        return None

    def classify(self, name: str, code: int, life: int) -> None:
        """Planned or unplanned (module docstring). Call before the gang's epoch moves for
        this exit."""
        reason = self.planned.pop((name, life), "")
        gang = self.gang_of.get(name)
        if not reason and code == 0 and name in self.completes:
            reason = "completed the run"
        if not reason and gang and life <= self.gang_epoch[gang]:
            reason = "stopped with its gang"
        if reason:
            self.exit_event(name, code, life, planned=reason)
        elif code == LOST_EXIT:  # SIGKILLed, or gone with its actor: was it its node?
            self.pending[(name, life)] = code
        else:
            self.exit_event(name, code, life, planned="")

    def settle_pending(self, procs: Mapping[str, ProcessRecord], *, final: bool = False) -> None:
        """Decide each SIGKILLed life whose process has started again (or moved): on another
        node, its node was lost (planned); on the same node, something killed it (unplanned).
        `final` (the run ends): one not started again is planned if its node is gone."""
        alive: set[str] | None = None
        for (name, life), code in list(self.pending.items()):
            record = procs.get(name)
            if record is None:
                continue
            node = record.life_nodes.get(life, "")
            later = [record.life_nodes[n] for n in sorted(record.life_nodes) if n > life]
            if later:
                went = later[0] != node
            elif record.moved is not None and record.moved.seq > life:
                went = record.moved.node_id != node
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
            self.exit_event(name, code, life, planned="its node was lost" if went else "")

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
        (a life that never reported, gone with its actor) from its part of the log."""
        try:
            answer = self.run.ray.get(self.run.registry.life_log.remote(name, life), timeout=_CALL_TIMEOUT_S)
            where = LifeLog(**answer)
        except Exception:  # the registry is gone: read the log from its start
            where = LifeLog()
        if where.tail is not None:
            return where.tail
        return log_part_tail(self.run.log_dir / f"{name}.log", where.start, where.end)

    def restart_gangs(self, procs: Mapping[str, ProcessRecord]) -> None:
        """Stop every member still running a life older than its gang's last restart."""
        for gang, names in self.gangs.items():
            for name in names:
                record = procs.get(name)
                if record is None or not record.running:
                    continue  # not running (restarting, or waiting for a move)
                if record.run < self.gang_epoch[gang] and (name, record.run) not in self.killed_lives:
                    self.killed_lives.add((name, record.run))
                    if self.kill(name, "stopped with its gang"):
                        self.induced[name] += 1

    def kill(self, name: str, why: str) -> int:
        """SIGKILL `name`'s component, and note the life it ended as planned (`why`). The
        life, or 0 when none runs, its actor restarting included (another process of its
        lost node: Ray is placing it again, with nothing to kill)."""
        ray = self.run.ray
        try:
            life = int(ray.get(self.run.actors[name].kill_component.remote(), timeout=_CALL_TIMEOUT_S))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            return 0
        if life:
            self.planned[(name, life)] = why
        return life

    def move(self, name: str, node_id: str) -> None:
        """`name` restarted on another node: the run gives it an address there; only the
        processes that learn its address at start alone are restarted."""
        dependents = self.run.move(name, node_id)
        for other in dependents:
            if self.kill(other, f"restarted because {name} moved"):
                self.induced[other] += 1
                self.run.event("restart_for_move", name=other, moved=name)
        if dependents:
            snap_seq = self.run.ray.get(self.run.registry.snapshot.remote(), timeout=_CALL_TIMEOUT_S)["seq"]
            for gang in {self.gang_of[n] for n in dependents if n in self.gang_of}:
                self.gang_epoch[gang] = snap_seq  # those kills are this move's, not a gang failure

    def chaos_tick(self, now: float, procs: Mapping[str, Any]) -> None:
        """The local supervisor's chaos mode: SIGKILL a component (its actor then restarts)."""
        records = processes(procs)
        run = self.run

        def running(role: str) -> list[str]:
            return [n for n, r in run.roles.items() if r == role and records.get(n, ProcessRecord()).running]

        picked = self.chaos.pick(now, list(run.roles.values()), running)
        if picked is not None:
            run.event("chaos_kill", name=picked[0], role=picked[1])
            self.kill(picked[0], "chaos kill")

    def dead_actor(self, procs: Mapping[str, Any]) -> RayReport | None:
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
                self.losses.answered[name] = time.time()
            except ray.exceptions.ActorUnavailableError:
                self.dead_pings[name] = 0
            except ray.exceptions.ActorDiedError as error:
                self.dead_pings[name] += 1
                if self.dead_pings[name] >= 2:
                    role, log_path = run.roles[name], run.log_dir / f"{name}.log"
                    starts = processes(procs).get(name, ProcessRecord(starts=1)).starts
                    return self.report(
                        False,
                        f"{name} died and Ray will not restart it (restarted {max(0, starts - 1)} time(s); "
                        f"launcher.resources.{role}.max_restarts="
                        f"{self.config.launcher.of(role).max_restarts}): {str(error)[:300]}. "
                        f"Last lines of {log_path}:\n{log_tail(log_path)}",
                        procs,
                    )
        for name, actor in run.actors.items():
            if name not in self.pings:
                self.pings[name] = actor.info.remote()
        return None
