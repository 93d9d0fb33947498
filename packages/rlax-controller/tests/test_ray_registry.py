"""The Ray launcher's registry: which life of a process each start and exit belongs to.

The registry is a plain class that Ray runs as an actor; its bookkeeping decides whether an
exit restarts a trainer gang (a life newer than the gang's last restart) and notices lives
that went down with their node without reporting an exit. Also the launcher's policies
that need no cluster: who restarts when a server moves, the health-check settings, the
report of a lost node. Whole runs on a Ray cluster are in tests/test_ray_launcher.py."""

from __future__ import annotations

from rlax_controller.ray_actors import LOST_EXIT, registry_class

NODE_A = {"node_id": "a", "node_ip": "10.0.0.1"}
NODE_B = {"node_id": "b", "node_ip": "10.0.0.2"}


def test_each_exit_names_the_life_it_ended() -> None:
    registry = registry_class()()
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
    registry = registry_class()()
    life = registry.started("worker0", {**NODE_A, "pid": 10})
    # The node vanished: the actor never reported an exit; Ray restarted it elsewhere.
    again = registry.started("worker0", {**NODE_B, "pid": 11})
    entry = registry.snapshot()["procs"]["worker0"]
    assert entry["exits"] == [LOST_EXIT] and entry["exit_runs"] == [life]
    assert entry["run"] == again and entry["node"]["node_id"] == "b"
    # Told apart from a component SIGKILLed on a live node (its own exit is -9 as well).
    assert entry["lost"] == [{"run": life, "node_id": "a"}]


def test_a_sigkilled_component_is_not_a_lost_life() -> None:
    registry = registry_class()()
    life = registry.started("worker0", NODE_A)
    registry.exited("worker0", -9, False, life)
    registry.started("worker0", NODE_A)
    entry = registry.snapshot()["procs"]["worker0"]
    assert entry["exits"] == [-9] and "lost" not in entry


def test_a_server_restarted_on_another_node_waits_as_moved() -> None:
    registry = registry_class()()
    life = registry.started("paramserver", NODE_A)
    registry.moved("paramserver", NODE_B)
    entry = registry.snapshot()["procs"]["paramserver"]
    assert entry["moved"]["node_id"] == "b" and entry["moved"]["seq"] == registry.snapshot()["seq"]
    assert entry["exits"] == [LOST_EXIT] and entry["exit_runs"] == [life]
    assert entry["lost"] == [{"run": life, "node_id": "a"}]
    assert entry["starts"] == len(entry["exits"])  # not running until the launcher starts it
    registry.started("paramserver", NODE_B)
    entry = registry.snapshot()["procs"]["paramserver"]
    assert "moved" not in entry and entry["exits"] == [LOST_EXIT]  # no second lost life


def test_a_final_exit_is_kept() -> None:
    registry = registry_class()()
    life = registry.started("controller", NODE_A)
    registry.exited("controller", 0, True, life)
    assert registry.snapshot()["procs"]["controller"]["final"] == 0


def test_a_moved_server_restarts_only_the_processes_that_learn_its_address_at_start() -> None:
    """Issue 29: losing a worker's node restarted the trainer too. Every client now reads a
    moved server's address in the run's address book; only a trainer gang's coordinator
    and the environments' verifier service are learnt once, at start."""
    from rlax_controller.ray_cluster import address_dependents
    from rlax_core.config import load_config

    config = load_config(None, ["workers.count=2", "verifier.mode=service"])
    for name in ("worker0", "worker1", "paramserver", "controller", "verifier"):
        assert address_dependents(config, name) == [], name
    gang = load_config(None, ["trainer.hosts=3"])
    assert address_dependents(gang, "trainer0") == ["trainer1", "trainer2"]
    agents = load_config(
        None,
        ["workers.count=2", "verifier.mode=service", "agent.environment=calculator", "agent.where=service"],
    )
    assert address_dependents(agents, "verifier") == ["worker0", "worker1"]


def test_health_check_settings_a_cluster_does_not_have_stop_the_launch() -> None:
    import pytest

    from rlax_controller.ray_cluster import check_health_config, health_check_text
    from rlax_core.config import ConfigError, load_config

    cluster = {
        "health_check_period_ms": 3000,
        "health_check_timeout_ms": 10000,
        "health_check_failure_threshold": 5,
    }
    assert "given up after ~15s" in health_check_text(cluster)
    check_health_config(load_config(None, []), cluster)  # nothing asked: the cluster's own
    same = load_config(None, ["launcher.health_check={period_s: 3, failure_threshold: 5}"])
    check_health_config(same, cluster)
    other = load_config(None, ["launcher.health_check.period_s=1"])
    with pytest.raises(ConfigError, match=r"health_check_period_ms=3000 \(asked: 1000\).*--system-config"):
        check_health_config(other, cluster)
    with pytest.raises(ConfigError, match="cannot be read"):
        check_health_config(other, {})


def test_the_report_names_each_lost_node_and_its_stall(tmp_path) -> None:
    from rlax_controller.run_report import RayReport

    stall = {
        "event": "node_lost",
        "node": "abcdef0123",
        "processes": ["worker0"],
        "stall_s": 14.2,
        "detect_s": 11.0,
    }
    report = RayReport(True, "done", {"worker0": 1}, [], {"worker0": [-9]}, tmp_path, stalls=[stall])
    text = report.render()
    assert "node lost abcdef01 (worker0): 14.2s from the loss to its replacements serving" in text
    assert "11.0s of it until Ray gave the node up" in text
