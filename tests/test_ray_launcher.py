"""`rlax launch` with `launcher.backend: ray` on a local three-node Ray cluster.

Ray binds and advertises the machine's own address unless told otherwise, so every test
that starts Ray runs `tests/ray_netns_run.py` inside a network namespace of its own that
has only loopback (`unshare --net`, `ip link set lo up`; every node on 127.0.0.1). The
helper starts the cluster (a service node, a trainer node and a worker node, each with
its custom resource), runs the cases, checks what is left running and stops the cluster
whatever happens. Without `unshare`/`ip` (or not as root) these tests FAIL, naming what
is missing: they are never skipped.
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
    proc = subprocess.run(
        ["unshare", "--net", "bash", "-c", inner],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
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


def check_run(case: dict[str, Any], steps: int) -> None:
    assert case.get("success"), case
    assert case["left"] == {"actors": [], "processes": []}, case["left"]
    expected = {"controller": "service_node", "paramserver": "service_node", "verifier": "service_node"}
    expected |= {"trainer": "trainer_node", "worker": "worker_node"}
    assert len(case["placed"]) == 6, case["placed"]
    for name, nodes in case["placed"].items():
        assert nodes == [expected[case["roles"][name]]], (name, nodes)


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


def test_ray_cluster_short(tmp_path: pathlib.Path) -> None:
    """Bad resource (fails at once naming the role), a role env without its package (exit
    69, the run stops with `pip install rlax-data`), then 4 steps of the demo, each role on
    the node its resources select; nothing left running after any of them."""
    python = env_without_data(tmp_path / "env-without-data")
    result = netns_run(
        tmp_path,
        "--cases=bad_resource,missing,run",
        f"--missing-python={python}",
        "run.steps=4",
        timeout=240,
    )
    bad = result["bad_resource"]
    assert not bad["success"] and bad["launch_s"] < 60, bad
    assert "launcher.resources.trainer" in bad["config_error"] and "tpu_v5p_slice" in bad["config_error"], bad
    assert bad["left"] == {"actors": [], "processes": []}, bad["left"]

    missing = result["missing"]
    assert not missing["success"] and missing["launch_s"] < 60, missing
    assert "verifier" in missing["reason"] and "pip install rlax-data" in missing["reason"], missing["reason"]
    assert missing["left"] == {"actors": [], "processes": []}, missing["left"]

    check_run(result["run"], 4)
    assert metrics_steps(tmp_path / "run" / "run") == [1, 2, 3, 4]
    logs = tmp_path / "run" / "run" / "logs"
    for name in ("controller", "trainer", "worker0", "worker1", "paramserver", "verifier"):
        assert (logs / f"{name}.log").stat().st_size > 0, name


@pytest.mark.slow
def test_ray_cluster_40_steps_with_chaos(tmp_path: pathlib.Path) -> None:
    """The issue's acceptance run (40 steps, every role on its node); the same run while
    worker0's and the parameter server's component processes are SIGKILLed from outside;
    and with the launcher's chaos mode (a kill of every targeted role)."""
    result = netns_run(tmp_path, "--cases=run,chaos,chaos_config", "run.steps=40", timeout=900)
    check_run(result["run"], 40)
    assert metrics_steps(tmp_path / "run" / "run") == list(range(1, 41))
    chaos = result["chaos"]
    check_run(chaos, 40)
    assert chaos["kills"] == ["worker0", "paramserver"], chaos
    assert chaos["restarts"]["worker0"] >= 1 and chaos["restarts"]["paramserver"] >= 1, chaos["restarts"]
    assert metrics_steps(tmp_path / "chaos" / "run") == list(range(1, 41))
    # chaos.interval on Ray: the launcher SIGKILLs one component of each targeted role
    # (worker, trainer, controller, paramserver) through its actor; the run finishes.
    own = result["chaos_config"]
    check_run(own, 40)
    assert sum(own["restarts"].values()) >= 4, own["restarts"]
    killed = [
        json.loads(line)
        for line in (tmp_path / "chaos_config" / "run" / "logs" / "events.jsonl").read_text().splitlines()
    ]
    roles = {e["role"] for e in killed if e["event"] == "chaos_kill"}
    assert roles == {"worker", "trainer", "controller", "paramserver"}, roles
    assert metrics_steps(tmp_path / "chaos_config" / "run") == list(range(1, 41))
