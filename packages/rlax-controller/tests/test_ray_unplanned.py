"""The Ray launcher tells planned exits from unplanned ones, as the local supervisor does.

`RaySupervision` runs here on fakes (no Ray cluster): the real registry class as a plain
object, actors whose `kill_component` reports the exit the way `RoleProcess` does, and a
`ray` that calls them directly. An exit with code 1 that nothing the launcher did explains
is unplanned, with the end of that life's log, in events.jsonl and in the report; a chaos
kill and a life lost with its node are planned; a SIGKILL from outside is told once its
process starts again (on the same node: unplanned; on another: its node was lost). Whole
runs on a Ray cluster are in tests/test_ray_launcher.py."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from rlax_controller.process_plan import ProcessSpec
from rlax_controller.ray_actors import LOST_EXIT, registry_class
from rlax_controller.ray_supervision import RaySupervision
from rlax_controller.testing import check_no_unplanned_restarts, unplanned_restarts
from rlax_core.config import load_config

NODE_A = {"node_id": "a", "node_ip": "10.0.0.1"}
NODE_B = {"node_id": "b", "node_ip": "10.0.0.2"}
TRACEBACK = 'Traceback (most recent call last):\n  File "worker.py", line 7\nValueError: boom'


class _Call:
    """`actor.method.remote(...)` that runs at once (`ray.get` returns the value)."""

    def __init__(self, method: Any) -> None:
        self.remote = method


class _Handle:
    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self._obj, name))


class _Actor:
    """What `RoleProcess.kill_component` does: SIGKILL the running life and name it; its
    watcher then reports the exit (-9) with the end of that life's log."""

    def __init__(self, name: str, registry: Any) -> None:
        self.name, self.registry = name, registry

    def kill_component(self) -> int:
        entry = self.registry.snapshot()["procs"][self.name]
        if entry["starts"] <= len(entry["exits"]):
            return 0
        self.registry.exited(self.name, -9, False, entry["run"], "")
        return int(entry["run"])


class _Ray:
    class exceptions:  # as ray.exceptions
        class ActorUnavailableError(Exception):
            pass

        class ActorDiedError(Exception):
            pass

    def __init__(self, alive: list[str]) -> None:
        self.alive = alive

    def get(self, value: Any, timeout: float | None = None) -> Any:
        return value

    def nodes(self) -> list[dict[str, Any]]:
        return [{"NodeID": n, "Alive": True} for n in self.alive]


class _Run:
    """The part of `RayRun` that `RaySupervision` uses."""

    def __init__(self, tmp: pathlib.Path, overrides: list[str]) -> None:
        self.config = load_config(None, overrides)
        self.output = tmp
        self.log_dir = tmp / "logs"
        self.log_dir.mkdir()
        self.events = self.log_dir / "events.jsonl"
        self.specs = [
            ProcessSpec("worker0", "worker", []),
            ProcessSpec("worker1", "worker", []),
            ProcessSpec("controller", "controller", [], completes_run=True),
        ]
        self.roles = {s.name: s.role for s in self.specs}
        self.registry_obj = registry_class()()
        self.registry = _Handle(self.registry_obj)
        self.actors = {s.name: _Handle(_Actor(s.name, self.registry_obj)) for s in self.specs}
        self.ray = _Ray(alive=["a", "b"])
        self.placement = {s.name: {"nodes": ["a"]} for s in self.specs}
        self.plans = {s.name: {"log": str(self.log_dir / f"{s.name}.log")} for s in self.specs}
        self.found: dict[str, str] = {}
        self.health_check = ""

    def event(self, kind: str, **fields: Any) -> None:
        with open(self.events, "a") as handle:
            handle.write(json.dumps({"event": kind, **fields}) + "\n")

    def write_placement(self) -> None:
        pass

    def start(self, name: str, node: dict[str, Any], output: str = "") -> int:
        """A life of `name` on `node`, as `RoleProcess.start` begins it: its log part first."""
        log = pathlib.Path(self.plans[name]["log"])
        with open(log, "ab") as handle:
            offset = handle.seek(0, 2)
            handle.write(f"--- {name} starting on {node['node_id']} ---\n{output}".encode())
        return int(self.registry_obj.started(name, node, offset))

    def exits(self) -> list[dict[str, Any]]:
        if not self.events.exists():
            return []
        return [e for e in map(json.loads, self.events.read_text().splitlines()) if e["event"] == "exit"]


def _tick(supervision: RaySupervision) -> dict[str, Any]:
    procs = supervision.run.registry_obj.snapshot()["procs"]
    for name, entry in procs.items():
        assert supervision.observe(name, entry, supervision.run.registry_obj.seq, procs) is None
    return procs


def _running(run: _Run, nodes: dict[str, dict[str, Any]] | None = None, output: str = "") -> RaySupervision:
    """Every process's first life (worker0's writes `output`), on NODE_A unless `nodes` says."""
    for name in ("worker0", "worker1", "controller"):
        run.start(name, (nodes or {}).get(name, NODE_A), output if name == "worker0" else "")
    supervision = RaySupervision(run)  # type: ignore[arg-type]
    _tick(supervision)
    return supervision


def test_a_crash_is_unplanned_with_its_traceback_and_a_chaos_kill_is_not(tmp_path: pathlib.Path) -> None:
    run = _Run(tmp_path, ["workers.count=2", "chaos.interval=5", "chaos.targets=[worker]", "chaos.seed=1"])
    supervision = _running(run, output="loading\n" + TRACEBACK + "\n")
    # worker0 crashes: exit code 1, its actor reports the end of that life's log.
    life = run.registry_obj.snapshot()["procs"]["worker0"]["run"]
    run.registry_obj.exited("worker0", 1, False, life, TRACEBACK)
    run.start("worker0", NODE_A, "a new life\n")
    _tick(supervision)
    (crash,) = supervision.unplanned
    assert (crash.name, crash.role, crash.code) == ("worker0", "worker", 1)
    assert crash.log_tail.endswith("ValueError: boom")
    event = run.exits()[-1]
    assert event["unplanned"] and event["code"] == 1 and event["log_tail"] == TRACEBACK

    # The launcher's chaos mode kills a worker: planned, said so in its exit event.
    supervision.next_kill = 0.0
    procs = run.registry_obj.snapshot()["procs"]
    supervision.chaos_tick(1.0, procs)
    ((victim, role),) = supervision.chaos_kills
    assert role == "worker"
    run.start(victim, NODE_A)
    procs = _tick(supervision)
    assert len(supervision.unplanned) == 1
    chaos_exit = run.exits()[-1]
    assert chaos_exit["name"] == victim and chaos_exit["code"] == -9
    assert chaos_exit["planned"] == "chaos kill" and "unplanned" not in chaos_exit

    # The report and events.jsonl (a launch in another process) name the crash alone.
    report = supervision.report(True, "controller completed the run", procs)
    assert report.unplanned_restarts == supervision.unplanned
    assert unplanned_restarts(tmp_path) == report.unplanned_restarts
    for source in (report, tmp_path):
        with pytest.raises(
            AssertionError, match=r"worker0 \(worker\) exited with code 1(.|\n)*ValueError: boom"
        ):
            check_no_unplanned_restarts(source)


def test_a_sigkill_from_outside_is_unplanned_and_a_lost_node_is_not(tmp_path: pathlib.Path) -> None:
    run = _Run(tmp_path, ["workers.count=2"])
    supervision = _running(run)
    # Something outside the launcher SIGKILLs worker1; Ray restarts it on the same node.
    life = run.registry_obj.snapshot()["procs"]["worker1"]["run"]
    run.registry_obj.exited("worker1", -9, False, life, "worker1 was serving")
    _tick(supervision)
    assert not supervision.unplanned and not run.exits()  # told once it starts again
    run.start("worker1", NODE_A)
    _tick(supervision)
    (killed,) = supervision.unplanned
    assert (killed.name, killed.code, killed.log_tail) == ("worker1", -9, "worker1 was serving")

    # worker0's node goes: its life never reports; Ray restarts it on node b.
    lost = run.registry_obj.snapshot()["procs"]["worker0"]["run"]
    run.start("worker0", NODE_B)
    # ... and worker1's component, killed with its node, reported its -9 first.
    life = run.registry_obj.snapshot()["procs"]["worker1"]["run"]
    run.registry_obj.exited("worker1", -9, False, life, "")
    run.start("worker1", NODE_B)
    procs = _tick(supervision)
    assert len(supervision.unplanned) == 1
    planned = {(e["name"], e["life"]): e.get("planned") for e in run.exits()}
    assert planned[("worker0", lost)] == planned[("worker1", life)] == "its node was lost"
    assert procs["worker0"]["exits"] == [LOST_EXIT]
    check_no_unplanned_restarts(tmp_path, caused=["worker1"])  # the one kill from outside, excused


def test_a_life_lost_on_a_live_node_is_unplanned_with_its_part_of_the_log(tmp_path: pathlib.Path) -> None:
    """An actor that died on a node that lives (its component never reported an exit): the
    end of that life's part of the log, not the next life's."""
    run = _Run(tmp_path, ["workers.count=2"])
    supervision = _running(run, output="first life\n" + TRACEBACK + "\n")
    run.start("worker0", NODE_A, "second life\n")  # the first never reported: lost on node a
    _tick(supervision)
    (gone,) = supervision.unplanned
    assert gone.code == LOST_EXIT and gone.log_tail.endswith("ValueError: boom")
    assert "second life" not in gone.log_tail and "first life" in gone.log_tail


def test_a_killed_process_not_started_again_by_the_end_is_told_by_its_node(tmp_path: pathlib.Path) -> None:
    run = _Run(tmp_path, ["workers.count=2"])
    supervision = _running(run, nodes={"worker1": {"node_id": "c", "node_ip": "10.0.0.3"}})
    for name in ("worker0", "worker1"):  # both SIGKILLed; node c is gone by the run's end
        entry = run.registry_obj.snapshot()["procs"][name]
        run.registry_obj.exited(name, -9, False, entry["run"], "")
    procs = _tick(supervision)
    report = supervision.report(True, "controller completed the run", procs)
    assert [u.name for u in report.unplanned_restarts] == ["worker0"]  # its node a is alive
    assert {e["name"]: e.get("planned") for e in run.exits()}["worker1"] == "its node was lost"
