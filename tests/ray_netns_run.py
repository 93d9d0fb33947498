"""Helper of tests/test_ray_launcher.py, run INSIDE a loopback-only network namespace
(`unshare --net`, `ip link set lo up`): starts a three-node Ray cluster on 127.0.0.1 (a
service node, a trainer node, a worker node, each with its custom resource), runs
`rlax launch` with `launcher.backend=ray` on it, checks what was left running, stops the
cluster (`ray stop --force`) whatever happened, and prints one JSON line
`RESULT {...}` for the test to read.

    python tests/ray_netns_run.py OUT_DIR [--bad-resource] [--chaos] [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from tiny_run import DEMO_CONFIG, TINY_RUN

RAY = str(pathlib.Path(sys.executable).with_name("ray"))
NODES = {"service_node": 3, "trainer_node": 1, "worker_node": 2}
ROLES = {
    "controller": "service_node",
    "paramserver": "service_node",
    "verifier": "service_node",
    "trainer": "trainer_node",
    "worker": "worker_node",
}
FAST = TINY_RUN


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_cluster(port: int) -> None:
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=4", "--disable-usage-stats"]
    first, *others = NODES.items()
    head = [RAY, "start", "--head", f"--port={port}", "--include-dashboard=false", *common]
    subprocess.run(
        [*head, f"--resources={json.dumps({first[0]: first[1]})}"], check=True, capture_output=True
    )
    for name, amount in others:
        subprocess.run(
            [
                RAY,
                "start",
                f"--address=127.0.0.1:{port}",
                *common,
                f"--resources={json.dumps({name: amount})}",
            ],
            check=True,
            capture_output=True,
        )


def node_resources(address: str) -> dict[str, dict[str, float]]:
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.monotonic() + 30
        while True:
            nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
            if len(nodes) >= len(NODES) or time.monotonic() > deadline:
                return nodes
            time.sleep(0.2)
    finally:
        ray.shutdown()


def leftovers(address: str, out: pathlib.Path) -> dict[str, Any]:
    """Actors still alive on the cluster and component processes still running."""
    import ray
    from ray._private.state import state

    ray.init(address=address, log_to_driver=False)
    try:
        alive = [a["Name"] or a["ActorID"] for a in state.actor_table(None).values() if a["State"] != "DEAD"]
    finally:
        ray.shutdown()
    procs = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(out) in cmdline and "ray_netns_run" not in cmdline:
            procs.append(cmdline[:200])
    return {"actors": alive, "processes": procs}


def chaos(out: pathlib.Path, names: list[str], stop: threading.Event, kills: list[str]) -> None:
    """SIGKILL each named component's process once, at steps 3, 6, ... of the run."""
    metrics = out / "run" / "metrics.jsonl"
    for i, name in enumerate(names):
        while not stop.is_set():
            steps = 0
            if metrics.exists():
                steps = sum(1 for line in metrics.read_text().splitlines() if '"train"' in line)
            if steps >= 3 * (i + 1):
                break
            time.sleep(0.2)
        if stop.is_set():
            return
        events = out / "run" / "logs" / "events.jsonl"
        pid = None
        for line in events.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "start" and record.get("name") == name:
                pid = record["pid"]
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append(name)
            except ProcessLookupError:
                pass


def run_case(
    out: pathlib.Path,
    address: str,
    nodes: dict[str, dict[str, float]],
    roles: dict[str, str],
    extra: list[str],
    chaos_names: list[str],
    pythons: dict[str, str],
) -> dict[str, Any]:
    from rich.console import Console

    from rlax_controller.launcher import launch
    from rlax_core.config import ConfigError

    resources = ", ".join(
        f"{role}: {{num_cpus: 0.5, resources: {{{node}: 1}}, max_restarts: -1"
        + (f", python: '{pythons[role]}'" if role in pythons else "")
        + "}"
        for role, node in roles.items()
    )
    overrides = [
        f"run.output_dir={out / 'run'}",
        *FAST,
        "launcher.backend=ray",
        f"launcher.address={address}",
        f"launcher.resources={{{resources}}}",
        *extra,
    ]
    result: dict[str, Any] = {}
    stop, kills = threading.Event(), []
    if chaos_names:
        threading.Thread(target=chaos, args=(out, chaos_names, stop, kills), daemon=True).start()
    t1 = time.monotonic()
    try:
        report = launch(str(DEMO_CONFIG), overrides, overwrite=True, console=Console(stderr=True))
        result.update(success=report.success, reason=report.reason, restarts=report.restarts)
    except ConfigError as error:
        result.update(success=False, config_error=str(error))
    finally:
        stop.set()
    result["launch_s"] = round(time.monotonic() - t1, 1)
    result["kills"] = kills
    placement_path = out / "run" / "logs" / "placement.json"
    placement = json.loads(placement_path.read_text()) if placement_path.exists() else {}
    result["placed"] = {
        name: sorted(k for k, v in nodes.get(p["node_id"], {}).items() if k in NODES and v > 0)
        for name, p in placement.items()
    }
    result["roles"] = {name: p["role"] for name, p in placement.items()}
    result["left"] = leftovers(address, out)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument(
        "--cases", default="run", help="comma-separated: bad_resource, missing, run, chaos, chaos_config"
    )
    parser.add_argument("--missing-python", default="", help="an interpreter with ray and rlax-core only")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    out = pathlib.Path(args.out).resolve()
    port = free_port()
    address = f"127.0.0.1:{port}"
    result: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        start_cluster(port)
        result["cluster_s"] = round(time.monotonic() - t0, 1)
        nodes = node_resources(address)
        for case in args.cases.split(","):
            roles, extra, chaos_names, pythons = dict(ROLES), list(args.overrides), [], {}
            if case == "bad_resource":
                roles["trainer"] = "tpu_v5p_slice"
            elif case == "missing":
                pythons["verifier"] = args.missing_python
            elif case == "chaos":
                chaos_names = ["worker0", "paramserver"]
            elif case == "chaos_config":  # the launcher's own chaos mode: every targeted role
                extra += ["chaos.interval=4", "chaos.max_kills=4", "chaos.seed=1"]
            result[case] = run_case(out / case, address, nodes, roles, extra, chaos_names, pythons)
    except Exception as error:  # reported to the test, which fails with it
        result["error"] = repr(error)
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
