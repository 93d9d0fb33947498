"""The Ray launcher's registry: which life of a process each start and exit belongs to.

The registry is a plain class that Ray runs as an actor; its bookkeeping decides whether an
exit restarts a trainer gang (a life newer than the gang's last restart) and notices lives
that went down with their node without reporting an exit. Whole runs on a Ray cluster are
in tests/test_ray_launcher.py."""

from __future__ import annotations

from rlax_controller.ray_launcher import LOST_EXIT, _registry_class

NODE_A = {"node_id": "a", "node_ip": "10.0.0.1"}
NODE_B = {"node_id": "b", "node_ip": "10.0.0.2"}


def test_each_exit_names_the_life_it_ended() -> None:
    registry = _registry_class()()
    first = registry.started("trainer0", NODE_A)
    other = registry.started("trainer1", NODE_A)
    registry.exited("trainer1", -9, False, other)
    second = registry.started("trainer1", NODE_A)
    snap = registry.snapshot()
    assert first < other < second <= snap["seq"]
    entry = snap["procs"]["trainer1"]
    assert entry["exits"] == [-9] and entry["exit_runs"] == [other] and entry["run"] == second
    assert entry["starts"] == 2 and entry["final"] is None


def test_a_life_lost_with_its_node_is_closed_when_the_process_starts_again() -> None:
    registry = _registry_class()()
    life = registry.started("worker0", {**NODE_A, "pid": 10})
    # The node vanished: the actor never reported an exit; Ray restarted it elsewhere.
    again = registry.started("worker0", {**NODE_B, "pid": 11})
    entry = registry.snapshot()["procs"]["worker0"]
    assert entry["exits"] == [LOST_EXIT] and entry["exit_runs"] == [life]
    assert entry["run"] == again and entry["node"]["node_id"] == "b"


def test_a_server_restarted_on_another_node_waits_as_moved() -> None:
    registry = _registry_class()()
    life = registry.started("paramserver", NODE_A)
    registry.moved("paramserver", NODE_B)
    entry = registry.snapshot()["procs"]["paramserver"]
    assert entry["moved"]["node_id"] == "b" and entry["moved"]["seq"] == registry.snapshot()["seq"]
    assert entry["exits"] == [LOST_EXIT] and entry["exit_runs"] == [life]
    assert entry["starts"] == len(entry["exits"])  # not running until the launcher starts it
    registry.started("paramserver", NODE_B)
    entry = registry.snapshot()["procs"]["paramserver"]
    assert "moved" not in entry and entry["exits"] == [LOST_EXIT]  # no second lost life


def test_a_final_exit_is_kept() -> None:
    registry = _registry_class()()
    life = registry.started("controller", NODE_A)
    registry.exited("controller", 0, True, life)
    assert registry.snapshot()["procs"]["controller"]["final"] == 0
