"""The Kubernetes examples under deploy/ hold together: every field `rlax launch
launcher.backend=ray` relies on is there and agrees with the run config it mounts.

No cluster and no Ray: the YAML is parsed and checked the way KubeRay turns a group into
`ray start` (num-cpus / num-gpus / memory from the pod's limits unless rayStartParams
names them; the `TPU` resource from a `google.com/tpu` limit; `resources` a JSON object,
quotes around it trimmed), then every process of every role is packed onto the Ray nodes
the groups make, by the resources the run config's `launcher.resources` asks for.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import re
import shlex
from typing import Any

import pytest
import yaml

from rlax_core.config import ROLES, RunConfig, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted(DEPLOY.rglob("*.yaml"))
RAYJOB_FILES = [p for p in YAML_FILES if p.name.startswith("rayjob-")]

# The image (REGISTRY/<name>:<tag>) each role's package is installed in: the node-install
# rule of docs/deployment.md (rlax-controller brings rlax-paramserver and rlax-data); a
# variant is named <image>-<variant> (rlax-worker-tpu).
IMAGE_OF_ROLE = {
    "controller": "rlax-controller",
    "paramserver": "rlax-controller",
    "verifier": "rlax-controller",
    "worker": "rlax-worker",
    "trainer": "rlax-trainer",
}
TPU_SELECTORS = ("cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology")
_QUANTITY = re.compile(r"^(?P<num>[0-9.]+)(?P<unit>Ki|Mi|Gi|Ti|k|M|G|T|m)?$")
_UNITS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def _docs(path: pathlib.Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _quantity(value: Any) -> float:
    """A Kubernetes quantity ("8", "500m", "32Gi", "40G") as a number."""
    match = _QUANTITY.match(str(value))
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group("num")) * _UNITS[match.group("unit")]


def parse_ray_resources(value: Any) -> dict[str, float]:
    """rayStartParams.resources: a string holding a JSON object of name -> amount, in
    KubeRay's form ('{"a": 1}', quotes around it trimmed) or the documented escaped one
    ('"{\\"a\\": 1}"')."""
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    text = value.strip().strip("'`").strip()
    if text.startswith('"'):
        text = json.loads(text)
    parsed = json.loads(text)
    if not isinstance(parsed, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and v > 0 for k, v in parsed.items()
    ):
        raise ValueError(f"must be a JSON object of name -> amount > 0, got {parsed!r}")
    return {k: float(v) for k, v in parsed.items()}


def _container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def node_capacity(group: dict[str, Any]) -> dict[str, float]:
    """What one Ray node (pod) of a group offers: CPU, GPU, memory in GB, custom resources;
    derived as KubeRay's generateRayStartCommand does."""
    params = group.get("rayStartParams") or {}
    limits = _container(group).get("resources", {}).get("limits", {})
    capacity: dict[str, float] = {}
    if "resources" in params:
        capacity.update(parse_ray_resources(params["resources"]))
    cpu = params.get("num-cpus", limits.get("cpu", 0))
    gpu = params.get("num-gpus", limits.get("nvidia.com/gpu", 0))
    memory = params.get("memory", limits.get("memory", 0))
    capacity["CPU"] = _quantity(cpu)
    capacity["GPU"] = _quantity(gpu)
    capacity["memory_gb"] = _quantity(memory) / 1e9
    if "google.com/tpu" in limits and "TPU" not in capacity:
        capacity["TPU"] = _quantity(limits["google.com/tpu"])
    return capacity


def role_request(config: RunConfig, role: str) -> dict[str, float]:
    wanted = config.launcher.of(role)
    request = {"CPU": wanted.num_cpus, "GPU": wanted.num_gpus, "memory_gb": wanted.memory_gb}
    request.update(wanted.resources)
    return {k: v for k, v in request.items() if v > 0}


def _fits(request: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(name, 0.0) >= amount - 1e-9 for name, amount in request.items())


def _image_name(group: dict[str, Any]) -> str:
    image = str(_container(group).get("image", ""))
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


def _groups(rayjob: dict[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
    """(name, group, Ray nodes it makes) for the head and every worker group."""
    spec = rayjob["spec"]["rayClusterSpec"]
    groups = [("head", spec["headGroupSpec"], 1)]
    for group in spec.get("workerGroupSpecs", []):
        nodes = int(group.get("replicas", 1)) * int(group.get("numOfHosts", 1))
        groups.append((group["groupName"], group, nodes))
    return groups


def _check_group(name: str, group: dict[str, Any], problems: list[str]) -> None:
    params = group.get("rayStartParams") or {}
    for key, value in params.items():
        if not isinstance(value, str):
            problems.append(f"{name}: rayStartParams.{key} = {value!r}: KubeRay wants a string")
    if "resources" in params:
        try:
            parse_ray_resources(params["resources"])
        except ValueError as error:
            problems.append(f"{name}: rayStartParams.resources {params['resources']!r}: {error}")
            return
    container = _container(group)
    limits = container.get("resources", {}).get("limits", {})
    requests = container.get("resources", {}).get("requests", {})
    for accelerator in ("nvidia.com/gpu", "google.com/tpu"):
        if accelerator in requests and str(requests[accelerator]) != str(limits.get(accelerator)):
            problems.append(f"{name}: {accelerator} request {requests[accelerator]} != limit")
    gpus = limits.get("nvidia.com/gpu")
    if "num-gpus" in params and _quantity(params["num-gpus"]) != _quantity(gpus or 0):
        problems.append(f"{name}: num-gpus {params['num-gpus']} but nvidia.com/gpu limit {gpus}")
    tpus = limits.get("google.com/tpu")
    if tpus is not None:
        selector = group["template"]["spec"].get("nodeSelector") or {}
        missing = [key for key in TPU_SELECTORS if key not in selector]
        if missing:
            problems.append(f"{name}: google.com/tpu without nodeSelector {', '.join(missing)}")
            return
        topology = [int(x) for x in str(selector[TPU_SELECTORS[1]]).split("x")]
        hosts = math.prod(topology) / _quantity(tpus)
        if hosts != int(group.get("numOfHosts", 1)):
            problems.append(
                f"{name}: topology {selector[TPU_SELECTORS[1]]} with {tpus} chips a host is "
                f"{hosts:g} hosts, numOfHosts is {group.get('numOfHosts', 1)}"
            )


def _config_path(entrypoint: str) -> tuple[str, list[str], list[str]]:
    """(config path, overrides, problems) of a `rlax launch CONFIG k=v ...` entrypoint."""
    args = shlex.split(entrypoint)
    if args[:2] != ["rlax", "launch"] or len(args) < 3:
        return "", [], [f"entrypoint {entrypoint!r} does not run `rlax launch CONFIG`"]
    overrides = [a for a in args[3:] if "=" in a and not a.startswith("-")]
    problems = []
    if "launcher.backend=ray" not in overrides:
        problems.append(f"entrypoint {entrypoint!r} lacks launcher.backend=ray")
    return args[2], overrides, problems


def _mounted_config(
    docs: list[dict[str, Any]], head: dict[str, Any], path: str
) -> tuple[str | None, list[str]]:
    """The run config text the head pod sees at `path` (from a mounted ConfigMap)."""
    folder, _, key = path.rpartition("/")
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in _container(head).get("volumeMounts", [])}
    if folder not in mounts:
        return None, [f"head mounts nothing at {folder} (entrypoint's config {path})"]
    volumes = {v["name"]: v for v in head["template"]["spec"].get("volumes", [])}
    source = volumes.get(mounts[folder], {}).get("configMap")
    if not source:
        return None, [f"head volume {mounts[folder]} at {folder} is not a ConfigMap"]
    maps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    text = maps.get(source["name"], {}).get("data", {}).get(key)
    if text is None:
        return None, [f"ConfigMap {source['name']} (in this file) has no key {key}"]
    return text, []


def pack(config: RunConfig, groups: list[tuple[str, dict[str, Any], int]]) -> list[str]:
    """Place every process of every role on the groups' Ray nodes (first fit, largest
    request first); problems name each role that has no place."""
    problems: list[str] = []
    nodes = [(name, node_capacity(group)) for name, group, count in groups for _ in range(count)]
    processes: list[tuple[str, dict[str, float]]] = []
    for role in ROLES:
        request = role_request(config, role)
        holders = [
            (name, group, count) for name, group, count in groups if _fits(request, node_capacity(group))
        ]
        if not holders:
            problems.append(f"role {role} ({request}): no group can hold it")
            continue
        for name, group, _ in holders:
            image = _image_name(group)
            if image != IMAGE_OF_ROLE[role] and not image.startswith(IMAGE_OF_ROLE[role] + "-"):
                problems.append(
                    f"role {role} fits group {name} whose image {image} lacks its "
                    f"package (wants {IMAGE_OF_ROLE[role]})"
                )
        if role == "worker":
            count = config.workers.count
        elif role == "verifier":
            count = 1 if config.verifier.mode == "service" else 0
        elif role == "trainer":
            # A multi-host trainer is one process per host of its slice (the gang).
            count = config.trainer.hosts
            slice_hosts = int(holders[0][1].get("numOfHosts", 1))
            if count != slice_hosts:
                problems.append(
                    f"trainer.hosts={count}, but the trainer's group {holders[0][0]} has "
                    f"numOfHosts={slice_hosts} (one trainer process per host)"
                )
            chips = count * request.get("TPU", request.get("GPU", 1.0))
            mesh = math.prod(config.trainer.mesh.values()) if config.trainer.mesh else chips
            if mesh != chips:
                problems.append(
                    f"trainer.mesh={config.trainer.mesh} spans {mesh} devices, the gang has {chips:g}"
                )
        else:
            count = 1
        processes += [(role, request)] * count
    processes.sort(key=lambda p: -sum(p[1].get(k, 0.0) for k in ("GPU", "TPU", "CPU")))
    for role, request in processes:
        for _, free in nodes:
            if _fits(request, free):
                for resource, amount in request.items():
                    free[resource] -= amount
                break
        else:
            problems.append(f"role {role} ({request}): no node has room left for this process")
    return problems


def check_rayjob_file(path: pathlib.Path, tmp_dir: pathlib.Path) -> list[str]:
    """Every problem of one KubeRay example file (empty: it holds together)."""
    docs = _docs(path)
    problems: list[str] = []
    rayjobs = [d for d in docs if d.get("kind") == "RayJob"]
    if len(rayjobs) != 1:
        return [f"{len(rayjobs)} RayJob documents, want 1"]
    rayjob = rayjobs[0]
    if rayjob.get("apiVersion") != "ray.io/v1":
        problems.append(f"RayJob apiVersion {rayjob.get('apiVersion')!r}, want ray.io/v1")
    spec = rayjob["spec"]
    if spec.get("shutdownAfterJobFinishes") is not True:
        problems.append("shutdownAfterJobFinishes is not true: the cluster outlives the run")
    if not isinstance(spec.get("ttlSecondsAfterFinished"), int):
        problems.append("ttlSecondsAfterFinished is not an integer")
    cluster = spec.get("rayClusterSpec") or {}
    if not str(cluster.get("rayVersion", "")).startswith("2."):
        problems.append(f"rayClusterSpec.rayVersion {cluster.get('rayVersion')!r}")
    groups = _groups(rayjob)
    for name, group, _ in groups:
        _check_group(name, group, problems)
    if problems:
        return problems
    config_path, overrides, entry_problems = _config_path(str(spec.get("entrypoint", "")))
    problems += entry_problems
    if not config_path:
        return problems
    text, mount_problems = _mounted_config(docs, groups[0][1], config_path)
    problems += mount_problems
    if text is None:
        return problems
    run_file = tmp_dir / f"{path.stem}-run.yaml"
    run_file.write_text(text)
    stored = load_config(run_file)
    if stored.launcher.backend != "ray":
        problems.append(f"the mounted run config's launcher.backend is {stored.launcher.backend!r}")
    config = load_config(run_file, overrides)
    if config.launcher.address != "auto":
        problems.append(f"launcher.address {config.launcher.address!r}: on the cluster it is auto")
    for section in ("controller", "paramserver", "verifier"):
        address = getattr(config, section).address
        if address != "auto":
            problems.append(f"{section}.address {address!r}: Ray discovers it, give auto")
    if config.workers.addresses:
        problems.append("workers.addresses given: Ray discovers them")
    return problems + pack(config, groups)


# --- the shipped examples ---------------------------------------------------------------


def test_there_are_examples_for_gpu_and_tpu() -> None:
    assert {p.name for p in RAYJOB_FILES} >= {"rayjob-gpu.yaml", "rayjob-tpu.yaml"}


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(DEPLOY)) for p in YAML_FILES])
def test_every_yaml_is_kubernetes_objects_or_a_run_config(path: pathlib.Path) -> None:
    docs = _docs(path)
    assert docs, f"{path}: empty"
    if all(isinstance(d, dict) and "apiVersion" in d for d in docs):
        for doc in docs:
            assert doc.get("kind") and doc.get("metadata", {}).get("name"), doc
    else:
        assert len(docs) == 1, f"{path}: a run config is one document"
        config = load_config(path)
        assert config.launcher.backend == "ray", f"{path}: a deploy/ run config runs on Ray"


@pytest.mark.parametrize("path", RAYJOB_FILES, ids=[p.name for p in RAYJOB_FILES])
def test_rayjob_holds_together(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    assert check_rayjob_file(path, tmp_path) == []


@pytest.mark.parametrize("path", RAYJOB_FILES, ids=[p.name for p in RAYJOB_FILES])
def test_mounted_run_config_is_the_file_beside_it(path: pathlib.Path) -> None:
    """rayjob-X.yaml's ConfigMap holds run-X.yaml verbatim, so the two cannot drift."""
    maps = [d for d in _docs(path) if d.get("kind") == "ConfigMap"]
    beside = path.with_name(path.name.replace("rayjob-", "run-"))
    assert [m["data"]["run.yaml"] for m in maps] == [beside.read_text()]


def test_tpu_example_puts_the_trainer_on_a_multi_host_slice() -> None:
    rayjob = next(d for d in _docs(DEPLOY / "kuberay/rayjob-tpu.yaml") if d["kind"] == "RayJob")
    groups = {name: group for name, group, _ in _groups(rayjob)}
    trainer = groups["rlax-trainer"]
    assert int(trainer["numOfHosts"]) > 1
    assert "google.com/tpu" in _container(trainer)["resources"]["limits"]
    config = load_config(DEPLOY / "kuberay/run-tpu.yaml")
    assert config.launcher.of("trainer").resources["TPU"] == node_capacity(trainer)["TPU"]
    assert config.trainer.hosts == int(trainer["numOfHosts"])
    assert config.launcher.of("trainer").placement == "STRICT_SPREAD"


def test_resources_value_forms() -> None:
    assert parse_ray_resources('\'{"a": 1, "TPU": 4}\'') == {"a": 1.0, "TPU": 4.0}
    assert parse_ray_resources('"{\\"a\\": 1}"') == {"a": 1.0}  # KubeRay docs' escaped form
    for bad in ('{"a": 1', "[1]", '{"a": 0}', 3):
        with pytest.raises(ValueError):
            parse_ray_resources(bad)


# --- broken copies fail -----------------------------------------------------------------


def _broken(path: pathlib.Path, tmp_path: pathlib.Path, edit: Any) -> list[str]:
    docs = copy.deepcopy(_docs(path))
    edit(docs)
    copy_path = tmp_path / path.name
    copy_path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    assert check_rayjob_file(path, tmp_path) == []  # the original is fine
    return check_rayjob_file(copy_path, tmp_path)


def _rayjob(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "RayJob")


def _group(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    spec = _rayjob(docs)["spec"]["rayClusterSpec"]
    if name == "head":
        return spec["headGroupSpec"]
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == name)


def _run_config(docs: list[dict[str, Any]], edit: Any) -> None:
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    raw = yaml.safe_load(cm["data"]["run.yaml"])
    edit(raw)
    cm["data"]["run.yaml"] = yaml.safe_dump(raw, sort_keys=False)


GPU = DEPLOY / "kuberay/rayjob-gpu.yaml"
TPU = DEPLOY / "kuberay/rayjob-tpu.yaml"


def _set(mapping: dict[str, Any], key: str, value: Any) -> None:
    mapping[key] = value


BREAKS = {
    "entrypoint without the ray backend": (
        GPU,
        lambda d: _set(_rayjob(d)["spec"], "entrypoint", "rlax launch /config/run.yaml"),
        "lacks launcher.backend=ray",
    ),
    "entrypoint not rlax launch": (
        GPU,
        lambda d: _set(_rayjob(d)["spec"], "entrypoint", "python train.py launcher.backend=ray"),
        "does not run `rlax launch",
    ),
    "wrong apiVersion": (GPU, lambda d: _set(_rayjob(d), "apiVersion", "ray.io/v1alpha1"), "apiVersion"),
    "resources not JSON": (
        GPU,
        lambda d: _set(_group(d, "rlax-worker")["rayStartParams"], "resources", "{rlax_worker: 1}"),
        "rayStartParams.resources",
    ),
    "worker group loses its custom resource": (
        GPU,
        lambda d: _set(_group(d, "rlax-worker")["rayStartParams"], "resources", "'{\"other\": 1}'"),
        "role worker",
    ),
    "GPU limit disagrees with num-gpus": (
        GPU,
        lambda d: _set(_container(_group(d, "rlax-trainer"))["resources"]["limits"], "nvidia.com/gpu", "2"),
        "num-gpus 1 but nvidia.com/gpu limit 2",
    ),
    "num-gpus as a number": (
        GPU,
        lambda d: _set(_group(d, "rlax-trainer")["rayStartParams"], "num-gpus", 1),
        "wants a string",
    ),
    "more workers than worker pods": (
        GPU,
        lambda d: _run_config(d, lambda raw: _set(raw["workers"], "count", 3)),
        "no node has room left",
    ),
    "run config on the local backend": (
        GPU,
        lambda d: _run_config(d, lambda raw: _set(raw["launcher"], "backend", "local")),
        "launcher.backend is 'local'",
    ),
    "a hand-typed address": (
        GPU,
        lambda d: _run_config(d, lambda raw: _set(raw["controller"], "address", "tcp://10.0.0.1:5555")),
        "controller.address",
    ),
    "ConfigMap not mounted where the entrypoint reads": (
        GPU,
        lambda d: _set(_rayjob(d)["spec"], "entrypoint", "rlax launch /etc/run.yaml launcher.backend=ray"),
        "head mounts nothing at /etc",
    ),
    "trainer gang smaller than its slice": (
        TPU,
        lambda d: _run_config(d, lambda raw: _set(raw["trainer"], "hosts", 2)),
        "numOfHosts=4",
    ),
    "trainer asks for more memory than its pod": (
        GPU,
        lambda d: _run_config(d, lambda raw: _set(raw["launcher"]["resources"]["trainer"], "memory_gb", 500)),
        "role trainer",
    ),
    "worker resource offered on the trainer's image": (
        GPU,
        lambda d: _set(
            _group(d, "rlax-trainer")["rayStartParams"],
            "resources",
            '\'{"rlax_trainer": 1, "rlax_worker": 1}\'',
        ),
        "lacks its package",
    ),
    "TPU group without its nodeSelector": (
        TPU,
        lambda d: _group(d, "rlax-trainer")["template"]["spec"]["nodeSelector"].pop(TPU_SELECTORS[1]),
        "without nodeSelector cloud.google.com/gke-tpu-topology",
    ),
    "TPU topology disagrees with numOfHosts": (
        TPU,
        lambda d: _set(_group(d, "rlax-trainer"), "numOfHosts", 2),
        "numOfHosts is 2",
    ),
    "TPU trainer asks for more chips than a host has": (
        TPU,
        lambda d: _run_config(
            d, lambda raw: _set(raw["launcher"]["resources"]["trainer"]["resources"], "TPU", 8)
        ),
        "role trainer",
    ),
}


@pytest.mark.parametrize("case", list(BREAKS), ids=list(BREAKS))
def test_a_broken_copy_fails(case: str, tmp_path: pathlib.Path) -> None:
    path, edit, expected = BREAKS[case]
    problems = _broken(path, tmp_path, edit)
    assert any(expected in problem for problem in problems), problems
