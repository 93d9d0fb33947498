"""`rlax launch` with `launcher.backend: ray` on a local multi-node Ray cluster.

Ray binds and advertises the machine's own address unless told otherwise, so every test
that starts Ray runs `tests/ray_netns_run.py` inside a network namespace of its own that
has only loopback (`unshare --net`, `ip link set lo up`; each node on its own 127.0.0.x, so
a process that moves to another node really changes address). The helper starts the
cluster (a head for the launcher; a service node, a trainer node and a worker node, each
with its custom resource; for the slow tests a second service and trainer node), runs the
cases, checks what is left running (actors, placement groups, processes) and stops the
cluster whatever happens. Without `unshare`/`ip` (or not as root) these tests FAIL, naming what
is missing: they are never skipped. Every run that finishes fails on any exit of a component
that neither the launcher (chaos, a gang restart, a move, a lost node) nor the helper's own
kills explain, with its traceback (`rlax_controller.testing.check_no_unplanned_restarts`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from rlax_controller.testing import check_no_unplanned_restarts, unplanned_restarts

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELPER = ROOT / "tests" / "ray_netns_run.py"
ENV = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "PYTHONHASHSEED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def netns_run(out: pathlib.Path, *args: str, timeout: float) -> dict[str, Any]:
    """Run the helper in a loopback-only network namespace; its RESULT line as a dict."""
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    assert not missing, (
        f"the Ray tests need {', '.join(missing)} (util-linux, iproute2) and root, to run Ray in a "
        "loopback-only network namespace; install them (.ci/run does) instead of skipping"
    )
    assert os.geteuid() == 0, (
        "the Ray tests need root for `unshare --net` (a loopback-only network namespace)"
    )
    inner = f"ip link set lo up && exec {sys.executable} {HELPER} {out} " + " ".join(f"'{a}'" for a in args)
    home = out / "home"  # Ray keeps state in ~/.ray (an auth token a local ray.init left there
    home.mkdir(parents=True, exist_ok=True)  # makes `ray start` of a worker node fail)
    proc = subprocess.run(
        ["unshare", "--net", "bash", "-c", inner],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**ENV, "HOME": str(home)},
        cwd=ROOT,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, (
        f"helper rc={proc.returncode}, no RESULT line:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    assert "error" not in result, f"{result['error']}\n{proc.stderr[-5000:]}"
    return result


def env_without_data(path: pathlib.Path) -> pathlib.Path:
    """An environment with ray, rlax-core and rlax-protocol but not rlax-data (the verifier)."""
    python = path / "bin" / "python"
    packages = [
        "ray==2.60.0",
        "-e",
        str(ROOT / "packages/rlax-core"),
        "-e",
        str(ROOT / "packages/rlax-protocol"),
    ]
    uv = shutil.which("uv")
    if uv:
        subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(path)], check=True)
        subprocess.run([uv, "pip", "install", "-q", "--python", str(python), *packages], check=True)
    else:
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    return python


NOTHING_LEFT = {"actors": [], "groups": [], "processes": []}


def check_run(case: dict[str, Any], steps: int) -> None:
    """The run finished, nothing is left on the cluster, every process ran only on nodes
    that carry its role's resource, and no component exited unless the launcher (chaos, a
    gang restart, a move, a lost node) or the helper's own kills (`caused`) explain it: a
    crash fails the test with its traceback."""
    assert case.get("success"), case
    assert case["left"] == NOTHING_LEFT, case["left"]
    check_no_unplanned_restarts(pathlib.Path(case["run_dir"]), caused=case["caused"])
    expected = {"controller": "service_node", "paramserver": "service_node", "verifier": "service_node"}
    expected |= {"trainer": "trainer_node", "worker": "worker_node"}
    for name, nodes in case["placed"].items():
        assert nodes == [expected[case["roles"][name]]], (name, nodes)
    if "summary" in case:
        assert case["summary"]["steps"] == list(range(1, steps + 1)), case["summary"]["steps"]
        assert case["summary"]["trained_exactly_once"], case["summary"]


def metrics_steps(run: pathlib.Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted({r["step"] for r in records if r.get("kind") == "train"})


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_address_fails_fast_naming_it(tmp_path: pathlib.Path) -> None:
    from rich.console import Console

    from rlax_controller.launcher import launch
    from rlax_core.config import ConfigError

    port = closed_port()
    start = time.monotonic()
    with (
        pytest.raises(ConfigError, match=f"launcher.address='127.0.0.1:{port}'"),
        open(os.devnull, "w") as null,
    ):
        launch(
            str(ROOT / "configs" / "demo.yaml"),
            [f"run.output_dir={tmp_path}", "launcher.backend=ray", f"launcher.address=127.0.0.1:{port}"],
            console=Console(file=null),
        )
    assert time.monotonic() - start < 60


@pytest.mark.slow  # in `nox -s slow`: the default suite stays under CI's 15 minutes
def test_ray_cluster_short(tmp_path: pathlib.Path) -> None:
    """Bad resource (fails at once naming the role), then 4 steps of the demo, each role on
    the node its resources select; nothing left running after either."""
    result = netns_run(tmp_path, "--cases=bad_resource,run", "run.steps=4", timeout=480)
    bad = result["bad_resource"]
    assert not bad["success"] and bad["launch_s"] < 60, bad
    assert "launcher.resources.trainer" in bad["config_error"] and "tpu_v5p_slice" in bad["config_error"], bad
    assert bad["left"] == NOTHING_LEFT, bad["left"]

    check_run(result["run"], 4)
    assert len(result["run"]["placed"]) == 6, result["run"]["placed"]
    assert metrics_steps(tmp_path / "run" / "run") == [1, 2, 3, 4]
    logs = tmp_path / "run" / "run" / "logs"
    for name in ("controller", "trainer", "worker0", "worker1", "paramserver", "verifier"):
        assert (logs / f"{name}.log").stat().st_size > 0, name


@pytest.mark.slow
def test_a_role_environment_without_its_package_stops_the_run_naming_it(tmp_path: pathlib.Path) -> None:
    """The verifier's environment lacks rlax-data: exit 69, the run stops with
    `pip install rlax-data`, nothing left running (slow: it builds an environment)."""
    python = env_without_data(tmp_path / "env-without-data")
    result = netns_run(tmp_path, "--cases=missing", f"--missing-python={python}", "run.steps=4", timeout=480)
    missing = result["missing"]
    assert not missing["success"] and missing["launch_s"] < 60, missing
    assert "verifier" in missing["reason"] and "pip install rlax-data" in missing["reason"], missing["reason"]
    assert missing["left"] == NOTHING_LEFT, missing["left"]
    # The verifier's exit 69 is the one the test caused; the launcher marks it unplanned, with its message.
    exits = unplanned_restarts(pathlib.Path(missing["run_dir"]))
    verifier = [e for e in exits if e.name == "verifier"]
    assert [e.code for e in verifier] == [69] and "rlax-data" in verifier[0].log_tail, exits


@pytest.mark.slow
def test_ray_cluster_40_steps_and_the_chaos_acceptance_run(tmp_path: pathlib.Path) -> None:
    """The issue's acceptance: 40 steps of the demo, every role on the node its resources
    select; then the same run at k=0 while the launcher's chaos mode SIGKILLs a worker, the
    trainer, the controller and the parameter server at random moments and the parameter
    server's node is lost at step 20: its servers move to the other service node, and the
    run finishes with the prompts, steps, trained rollouts and final weights of an
    undisturbed local run."""
    result = netns_run(tmp_path, "--cases=run,acceptance", "--spare-nodes", "run.steps=40", timeout=1500)
    check_run(result["run"], 40)
    assert len(result["run"]["placed"]) == 6, result["run"]["placed"]
    assert metrics_steps(tmp_path / "run" / "run") == list(range(1, 41))

    run, local = result["acceptance"], result["local_reference"]
    assert local["success"], local
    check_run(run, 40)
    lost = run["first_ip"]["paramserver"]
    assert run["disturbed"] == [f"node:{lost}"], run["disturbed"]
    killed = {e["role"] for e in run["events"] if e["event"] == "chaos_kill"}
    assert killed == {"worker", "trainer", "controller", "paramserver"}, killed
    moved = {e["name"] for e in run["events"] if e["event"] == "moved"}
    assert moved == {name for name, ip in run["first_ip"].items() if ip == lost}, (moved, run["first_ip"])
    for name in moved:  # ran on the lost service node, then on the other one
        assert len(set(run["nodes_of"][name])) == 2, run["nodes_of"]
    ours, theirs = run["summary"], local["summary"]
    assert ours["consumed"] == theirs["consumed"]
    assert theirs["trained_exactly_once"] and theirs["weights_version"] == 40
    assert ours["weights_version"] == 40
    assert ours["weights_sha256"] == theirs["weights_sha256"]


@pytest.mark.slow
def test_ray_trainer_gang_and_external_kills(tmp_path: pathlib.Path) -> None:
    """A trainer gang of two (one process per trainer node, STRICT_SPREAD) whose second
    member is SIGKILLed: the whole gang restarts and the run finishes; components SIGKILLed
    from outside Ray restart."""
    result = netns_run(tmp_path, "--cases=gang,chaos", "--spare-nodes", "run.steps=8", timeout=1200)
    gang = result["gang"]
    check_run(gang, 8)
    assert gang["disturbed"] == ["trainer1"], gang
    assert set(gang["nodes_of"]["trainer0"]).isdisjoint(gang["nodes_of"]["trainer1"]), gang["nodes_of"]
    restarts = [e for e in gang["events"] if e["event"] == "gang_restart"]
    assert [e["cause"] for e in restarts] == ["trainer1"], restarts
    assert gang["restarts"]["trainer0"] >= 1 and gang["restarts"]["trainer1"] >= 1, gang["restarts"]

    chaos = result["chaos"]
    check_run(chaos, 8)
    assert chaos["disturbed"] == ["worker0", "paramserver"], chaos
    assert chaos["restarts"]["worker0"] >= 1 and chaos["restarts"]["paramserver"] >= 1, chaos["restarts"]


HEALTH_CHECK = "launcher.health_check={period_s: 1, failure_threshold: 10}"  # the helper's cluster's


@pytest.mark.slow
def test_a_lost_worker_node_restarts_its_workers_alone(tmp_path: pathlib.Path) -> None:
    """Issue 29: the node that holds the two workers and nothing else is lost at step 3. The
    workers restart on the other worker node, at new addresses that the controller reads
    in the run's address book; the trainer, the parameter server, the controller and the
    verifier are not restarted (one start each, the same pids), the run finishes with the
    prompts, trained rollouts and final weights of an undisturbed local run, and the stall
    from the loss to the replacements serving is recorded (launcher_metrics.jsonl,
    events.jsonl, the report). Slow (~3 min: a local reference run, then the Ray run)."""
    result = netns_run(tmp_path, "--cases=worker_loss", "run.steps=10", HEALTH_CHECK, timeout=1200)
    run, local = result["worker_loss"], result["local_reference"]
    assert local["success"], local
    check_run(run, 10)
    lost = run["first_ip"]["worker0"]
    assert run["disturbed"] == [f"node:{lost}"], run["disturbed"]
    assert [n for n, ip in run["first_ip"].items() if ip == lost] == ["worker0", "worker1"], run["first_ip"]
    moved = [e for e in run["events"] if e["event"] == "moved"]
    assert sorted(e["name"] for e in moved) == ["worker0", "worker1"], moved
    assert all(e["address"] != e["old"] for e in moved), moved
    for name in ("trainer", "paramserver", "controller", "verifier"):
        starts = [e for e in run["events"] if e["event"] == "start" and e["name"] == name]
        assert len(starts) == 1 and run["restarts"][name] == 0, (name, starts, run["restarts"])
    assert not [e for e in run["events"] if e["event"] in ("restart_for_move", "gang_restart")]
    ours, theirs = run["summary"], local["summary"]
    assert ours["consumed"] == theirs["consumed"]
    assert theirs["trained_exactly_once"] and ours["trained_exactly_once"]
    assert ours["weights_version"] == theirs["weights_version"] == 10
    assert ours["weights_sha256"] == theirs["weights_sha256"]
    # The stall: one record for the lost node, in launcher_metrics.jsonl, events.jsonl, the report.
    (loss,) = run["stall"]["losses"]
    assert loss["event"] == "node_lost" and loss["processes"] == ["worker0", "worker1"], loss
    assert 0 < loss["detect_s"] <= loss["stall_s"], loss
    (event,) = [e for e in run["events"] if e["event"] == "node_lost"]
    assert (event["processes"], event["stall_s"]) == (loss["processes"], loss["stall_s"]), event
    expected = f"node lost {event['node'][:8]} (worker0, worker1): {loss['stall_s']:.1f}s"
    assert expected in run["report"], run["report"]
    health = [e for e in run["events"] if e["event"] == "health_check"]
    assert health and health[0]["health_check_period_ms"] == 1000, health
