"""Helper of tests/test_ray_launcher.py, run INSIDE a loopback-only network namespace
(`unshare --net`, `ip link set lo up`): starts a Ray cluster whose nodes each have an
address of their own on the loopback network (127.0.0.1 the head, which only runs the
launcher; 127.0.0.2 a service node; 127.0.0.3 a trainer node; 127.0.0.4 a worker node;
with `--spare-nodes`, a second service node 127.0.0.5 and a second trainer node
127.0.0.6; with the `worker_loss` case, a second worker node 127.0.0.7),
runs `rlax launch` with `launcher.backend=ray` on it for each case, checks what was left
running, stops the cluster whatever happened, and prints one JSON line `RESULT {...}` for
the test to read. Each case's result names its run folder and the components the helper
SIGKILLed itself, for the test's `check_no_unplanned_restarts`; a local reference run is
checked here.

The cluster is a `ray.cluster_utils.Cluster` of this process, under a Ray temp folder of
its own (`RAY_TMPDIR`): a lost node is its node removed (every process of that node
SIGKILLed), and the end stops exactly the processes it started, never another cluster on
the host (`ray stop` would stop every Ray process of the machine, other users' too).

    python tests/ray_netns_run.py OUT_DIR --cases=run,... [--spare-nodes] [override ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from tiny_run import DEMO_CONFIG, TINY_RUN

ROLE_RESOURCES = ("service_node", "trainer_node", "worker_node")
NODES = [
    ("127.0.0.2", {"service_node": 3}),
    ("127.0.0.3", {"trainer_node": 1}),
    ("127.0.0.4", {"worker_node": 2}),
]
SPARE_NODES = [("127.0.0.5", {"service_node": 3}), ("127.0.0.6", {"trainer_node": 1})]
# worker_loss: a second worker node, where the workers of the lost one move.
SPARE_WORKER_NODE = ("127.0.0.7", {"worker_node": 2})
ROLES = {
    "controller": "service_node",
    "paramserver": "service_node",
    "verifier": "service_node",
    "trainer": "trainer_node",
    "worker": "worker_node",
}
# The head gives a node up after ~10 s without answers to its health checks (Ray's default:
# ~15 s, more for a vanished host); the launcher's `launcher.health_check` names the same.
HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 10}


def start_cluster(nodes: list[tuple[str, dict[str, int]]]) -> tuple[Any, dict[str, Any]]:
    """The head (127.0.0.1) and one Ray node per (ip, resources): the cluster and its nodes by ip."""
    from ray.cluster_utils import Cluster

    head = {"node_ip_address": "127.0.0.1", "num_cpus": 4, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**head, "_system_config": HEALTH_CHECK})
    by_ip = {}
    try:
        for ip, resources in nodes:
            by_ip[ip] = cluster.add_node(node_ip_address=ip, num_cpus=4, resources=dict(resources))
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, by_ip


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (a component started with setsid included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def lose(cluster: Any, node: Any) -> None:
    """The node is lost with everything on it, as when its machine goes: its Ray processes
    and, at the same moment, every process they started (actors and their components; a
    raylet's actors may otherwise outlive it for a while, still serving on its address)."""
    raylet = node.all_processes["raylet"][0].process.pid
    doomed = descendants(raylet)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cluster.remove_node(node, allow_graceful=False)


def node_resources(address: str, count: int) -> dict[str, dict[str, float]]:
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.monotonic() + 30
        while True:
            nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
            if len(nodes) >= count or time.monotonic() > deadline:
                return nodes
            time.sleep(0.2)
    finally:
        ray.shutdown()


def leftovers(address: str, out: pathlib.Path) -> dict[str, Any]:
    """Actors and placement groups still alive on the cluster, component processes still running."""
    import ray
    from ray._private.state import state  # every actor, named or not (test code only)
    from ray.util import placement_group_table

    ray.init(address=address, log_to_driver=False)
    try:
        alive = [a["Name"] or a["ActorID"] for a in state.actor_table(None).values() if a["State"] != "DEAD"]
        groups = [g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
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
    return {"actors": alive, "groups": groups, "processes": procs}


def train_steps(run: pathlib.Path) -> int:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"train"' in line)


def last_start_pid(run: pathlib.Path, name: str) -> int | None:
    pid = None
    for line in (run / "logs" / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start" and record.get("name") == name:
            pid = record["pid"]
    return pid


def disturb(
    run: pathlib.Path,
    plan: list[tuple[int, str]],
    stop: threading.Event,
    done: list[str],
    lose_node: Callable[[str], None],
    lost_at: list[float],
) -> None:
    """At each (step, target): SIGKILL the component `target`, or with `node_of:NAME` lose
    the node that process was placed on (every process of that Ray node SIGKILLed)."""
    for step, target in plan:
        while not stop.is_set() and train_steps(run) < step:
            time.sleep(0.2)
        if stop.is_set():
            return
        if target.startswith("node_of:"):  # the node a process was first placed on
            placed = json.loads((run / "logs" / "placement.json").read_text())
            ip = placed[target.removeprefix("node_of:")]["node_ip"]
            lost_at.append(time.time())
            lose_node(ip)
            done.append(f"node:{ip}")
            continue
        pid = last_start_pid(run, target)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
                done.append(target)
            except ProcessLookupError:
                pass


def run_summary(run: pathlib.Path) -> dict[str, Any]:
    """What the acceptance checks compare: prompts consumed per step, the steps, whether
    every accepted rollout was trained exactly once, and the final weights' hash."""
    from rlax_controller.metrics import latest_per_step, read_metrics
    from rlax_paramserver.persist import load_newest

    train = latest_per_step(read_metrics(run / "metrics.jsonl", kind="train"))
    trainer = latest_per_step(r for r in read_metrics(run / "trainer_metrics.jsonl") if r["kind"] == "train")
    accepted = {r["step"]: r["rollout_ids"] for r in train}
    trained = {r["step"]: r["rollout_ids"] for r in trainer}
    ids = [i for step in sorted(trained) for i in trained[step]]
    state, _ = load_newest(run / "paramserver")
    digest = hashlib.sha256()
    if state is not None:
        digest.update(str(state.version).encode())
        for frame in state.frames:
            digest.update(frame)
    return {
        "steps": sorted(accepted),
        "consumed": [r["consumed_prompt_ids"] for r in train],
        "trained_exactly_once": accepted == trained and len(ids) == len(set(ids)),
        "weights_version": None if state is None else state.version,
        "weights_sha256": digest.hexdigest(),
    }


def run_case(
    out: pathlib.Path,
    address: str,
    nodes: dict[str, dict[str, float]],
    roles: dict[str, str],
    extra: list[str],
    disturbances: list[tuple[int, str]],
    pythons: dict[str, str],
    placement: dict[str, str] | None = None,
    lose_node: Callable[[str], None] = lambda ip: None,
) -> dict[str, Any]:
    from rich.console import Console

    from rlax_controller.launcher import launch
    from rlax_core.config import ConfigError

    resources = ", ".join(
        f"{role}: {{num_cpus: 0.5, resources: {{{node}: 1}}, max_restarts: -1"
        + (f", python: '{pythons[role]}'" if role in pythons else "")
        + (f", placement: {placement[role]}" if placement and role in placement else "")
        + "}"
        for role, node in roles.items()
    )
    overrides = [
        f"run.output_dir={out / 'run'}",
        *TINY_RUN,
        "launcher.backend=ray",
        f"launcher.address={address}",
        f"launcher.resources={{{resources}}}",
        *extra,
    ]
    result: dict[str, Any] = {}
    stop, done, lost_at = threading.Event(), [], []
    if disturbances:
        threading.Thread(
            target=disturb, args=(out / "run", disturbances, stop, done, lose_node, lost_at), daemon=True
        ).start()
    t1 = time.monotonic()
    try:
        report = launch(str(DEMO_CONFIG), overrides, overwrite=True, console=Console(stderr=True))
        result.update(success=report.success, reason=report.reason, restarts=report.restarts)
        result["report"] = report.render()
    except ConfigError as error:
        result.update(success=False, config_error=str(error))
    finally:
        stop.set()
    result["launch_s"] = round(time.monotonic() - t1, 1)
    result["disturbed"] = done
    # For `check_no_unplanned_restarts` in the test: the run folder (its logs/events.jsonl),
    # and the components this helper SIGKILLed itself (a lost node's processes are the
    # launcher's to excuse: their next life is on another node).
    result["run_dir"] = str(out / "run")
    result["caused"] = [target for target in done if not target.startswith("node:")]
    placement_path = out / "run" / "logs" / "placement.json"
    placed = json.loads(placement_path.read_text()) if placement_path.exists() else {}
    # Every node a process ran on (a restart may move it), by the role resources it carries.
    result["placed"] = {
        name: sorted(
            {
                k
                for node in p.get("nodes", [p["node_id"]])
                for k, v in nodes.get(node, {}).items()
                if k in ROLE_RESOURCES and v > 0
            }
        )
        for name, p in placed.items()
    }
    result["nodes_of"] = {name: p.get("nodes", [p["node_id"]]) for name, p in placed.items()}
    result["first_ip"] = {name: p["node_ip"] for name, p in placed.items()}
    result["roles"] = {name: p["role"] for name, p in placed.items()}
    result["left"] = leftovers(address, out)
    events = out / "run" / "logs" / "events.jsonl"
    result["events"] = (
        [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    )
    if result.get("success"):
        result["summary"] = run_summary(out / "run")
    if lost_at:
        result["stall"] = stall_figures(out / "run", lost_at[0])
    return result


def stall_figures(run: pathlib.Path, lost_at: float) -> dict[str, Any]:
    """What a lost node cost, as the run's metrics show it: the launcher's `node_lost`
    records, and (measured the same way whichever launcher ran) the longest wait for a
    trained step after the loss, against the median step."""
    launcher = run / "launcher_metrics.jsonl"
    losses = [json.loads(line) for line in launcher.read_text().splitlines()] if launcher.exists() else []
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times: dict[int, float] = {}
    for r in records:
        if r.get("kind") == "train":
            times.setdefault(r["step"], r["time"])
    ordered = [times[s] for s in sorted(times)]
    pairs = list(zip(ordered, ordered[1:], strict=False))
    gaps = sorted(b - a for a, b in pairs)
    after = [b - max(a, lost_at) for a, b in pairs if b > lost_at]
    return {
        "losses": losses,
        "lost_at": lost_at,
        "longest_wait_after_loss_s": round(max(after), 2) if after else None,
        "median_step_s": round(gaps[len(gaps) // 2], 2) if gaps else None,
    }


def local_reference(out: pathlib.Path, extra: list[str]) -> dict[str, Any]:
    """The same run with the local launcher, undisturbed."""
    from rich.console import Console

    from rlax_controller.launcher import launch
    from rlax_controller.testing import check_no_unplanned_restarts

    overrides = [f"run.output_dir={out / 'run'}", *TINY_RUN, *extra]
    report = launch(str(DEMO_CONFIG), overrides, overwrite=True, console=Console(stderr=True))
    # The reference may hide no crash either (raises: the helper's `error`, the test fails with it).
    check_no_unplanned_restarts(report)
    return {"success": report.success, "reason": report.reason, "summary": run_summary(out / "run")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument(
        "--cases",
        default="run",
        help="comma-separated: bad_resource, missing, run, chaos, acceptance, gang, worker_loss",
    )
    parser.add_argument("--missing-python", default="", help="an interpreter with ray and rlax-core only")
    parser.add_argument("--spare-nodes", action="store_true", help="a second service and trainer node")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    out = pathlib.Path(args.out).resolve()
    layout = NODES + (SPARE_NODES if args.spare_nodes else [])
    if "worker_loss" in args.cases.split(","):
        layout = [*layout, SPARE_WORKER_NODE]
    # Ray's sessions, sockets and address file in a folder of this run's own, removed at the end.
    os.environ["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="rlax-ray-")
    result: dict[str, Any] = {}
    cluster = None
    t0 = time.monotonic()
    try:
        cluster, by_ip = start_cluster(layout)
        address = cluster.address
        result["cluster_s"] = round(time.monotonic() - t0, 1)
        nodes = node_resources(address, len(layout) + 1)

        def lose_node(ip: str) -> None:
            lose(cluster, by_ip.pop(ip))

        for case in args.cases.split(","):
            roles, extra, disturbances, pythons = dict(ROLES), list(args.overrides), [], {}
            placement = None
            if case == "bad_resource":
                roles["trainer"] = "tpu_v5p_slice"
            elif case == "missing":
                pythons["verifier"] = args.missing_python
            elif case == "chaos":  # components SIGKILLed from outside Ray
                disturbances = [(3, "worker0"), (6, "paramserver")]
            elif case == "acceptance":
                # The launcher's chaos mode kills a worker, the trainer, the controller and the
                # parameter server at seeded random moments; the parameter server's node is
                # lost at step 20 and the servers on it move to the other service node.
                # Compared with an undisturbed local run at k=0.
                extra += ["trainer.k=0", "workers.j=1"]
                chaos = ["chaos.interval=15", "chaos.max_kills=4", "chaos.seed=3"]
                disturbances = [(20, "node_of:paramserver")]
                result["local_reference"] = local_reference(out / "local", extra)
                extra += chaos
            elif case == "gang":  # a trainer gang of two, one per trainer node; a member killed
                extra += ["trainer.hosts=2", "trainer.k=0", "workers.j=1"]
                placement = {"trainer": "STRICT_SPREAD"}
                disturbances = [(3, "trainer1")]
            elif case == "worker_loss":
                # The node that holds both workers (and nothing else) is lost at step 3: they
                # move to the other worker node; compared with an undisturbed local run at k=0.
                extra += ["trainer.k=0", "workers.j=1"]
                placement = {"worker": "PACK"}
                disturbances = [(3, "node_of:worker0")]
                result["local_reference"] = local_reference(out / "local", extra)
            result[case] = run_case(
                out / case, address, nodes, roles, extra, disturbances, pythons, placement, lose_node
            )
    except Exception as error:  # reported to the test, which fails with it
        import traceback

        result["error"] = repr(error) + "\n" + traceback.format_exc()[-3000:]
    finally:
        if cluster is not None:
            cluster.shutdown()  # this cluster's processes, and no other
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
