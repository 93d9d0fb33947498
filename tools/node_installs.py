"""Each node role in a virtual environment of its own, installed from the checkout.

    python tools/node_installs.py --out DIR [--fresh] [--demo-steps N] [--reference-python PY]

For each node role (controller, paramserver, verifier, worker, trainer) this makes a
virtual environment `DIR/<role>` with only the role's package and the RLAX packages it
depends on (the closure is read from the `pyproject.toml` files), installed NON-editable
from the checkout, with uv when available (its cache makes it fast), else venv + pip.
Then, for each environment:

  (a) its entry point starts: `rlax-paramserver` and `rlax-verifier` really serve (bound
      on `tcp://127.0.0.1:*`, port answering, stopped with SIGTERM, exit 0); the trainer,
      the worker and the controller pass `--check-config` on a demo-like config; and the
      `rlax` front door names the package to install for each component not installed;
  (b) the forbidden distributions are absent (no JAX on a controller, parameter-server or
      verifier node; no optax/orbax/trainer on a worker; no engine/kernels on a trainer;
      torch nowhere);
  (c) its installed size (site-packages) is printed in a table.

`--demo-steps N` then runs the demo for N steps with every component started from its own
environment (`rlax launch` from the controller's environment with
`supervisor.interpreters.<role>`, the verifier as a service), and again from a single
environment (`--reference-python`, default `.nox/tests/bin/python`), and compares the
training reward of the two runs (`metrics.jsonl`, kind == "train").

An environment is reused only when a fingerprint of everything that goes into it (the
pyproject, README and source files of every package in its closure, the Python and uv
versions) is unchanged; anything else recreates it, so a stale environment never hides a
new dependency or an old source file. `--fresh` always recreates.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"

JAX_STACK = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


@dataclass(frozen=True)
class Role:
    name: str
    package: str  # the distribution a node of this role installs
    forbidden: tuple[str, ...]


ROLES = (
    Role("controller", "rlax-controller", (*JAX_STACK, "torch")),
    Role("paramserver", "rlax-paramserver", (*JAX_STACK, "torch")),
    Role("verifier", "rlax-data", (*JAX_STACK, "torch")),
    Role("worker", "rlax-inference", ("optax", "orbax-checkpoint", "rlax-trainer", "torch")),
    Role("trainer", "rlax-trainer", ("rlax-inference", "rlax-kernels", "torch")),
)

# Same environment as the nox sessions: CPU JAX, deterministic hashing, no hub downloads.
CPU_ENV = {
    "JAX_PLATFORMS": "cpu",
    "PYTHONHASHSEED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}

EXIT_MISSING_COMPONENT = 69


class Failure(Exception):
    """A check failed; the message says which and why."""


def log(message: str) -> None:
    print(f"[node_installs] {message}", flush=True)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise Failure(f"cannot read a distribution name from requirement {requirement!r}")
    return normalize(match.group(1))


def is_rlax(name: str) -> bool:
    # `rlax` alone is DeepMind's library on PyPI, never one of ours.
    return name.startswith("rlax-")


# --------------------------------------------------------------------------- closure


def local_packages() -> dict[str, Path]:
    """Distribution name -> folder, for every package of the checkout."""
    folders = [ROOT / "kernels", *sorted((ROOT / "packages").iterdir())]
    found: dict[str, Path] = {}
    for folder in folders:
        pyproject = folder / "pyproject.toml"
        if not pyproject.is_file():
            continue
        name = normalize(tomllib.loads(pyproject.read_text())["project"]["name"])
        if name in found:
            raise Failure(f"two folders build {name}: {found[name]} and {folder}")
        found[name] = folder
    return found


def rlax_dependencies(folder: Path) -> list[str]:
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    return [n for n in (requirement_name(r) for r in project.get("dependencies", [])) if is_rlax(n)]


def closure(package: str, packages: dict[str, Path]) -> list[str]:
    """`package` and every RLAX package it depends on (runtime dependencies only), bottom first."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str, wanted_by: str) -> None:
        if name in order:
            return
        if name not in packages:
            raise Failure(
                f"{wanted_by} names the RLAX dependency {name!r}, but no folder of the checkout "
                f"builds it (packages found: {', '.join(sorted(packages))})"
            )
        if name in visiting:
            raise Failure(f"dependency cycle through {name}")
        visiting.add(name)
        pyproject = packages[name].relative_to(ROOT) / "pyproject.toml"
        for dependency in rlax_dependencies(packages[name]):
            visit(dependency, str(pyproject))
        visiting.discard(name)
        order.append(name)

    visit(package, "the role table")
    return order


def fingerprint(names: list[str], packages: dict[str, Path], python: str, installer: list[str]) -> str:
    """Hash of everything an environment is built from: a change anywhere recreates it."""
    digest = hashlib.sha256()
    digest.update(sys.version.encode())
    digest.update(python.encode())
    digest.update(" ".join(installer).encode())
    if installer[0] != "pip":
        digest.update(
            subprocess.run([*installer, "--version"], capture_output=True, text=True).stdout.encode()
        )
    for name in names:
        folder = packages[name]
        digest.update(name.encode())
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo"):
                continue
            if rel.parts[0] in ("tests", "benchmarks", ".pytest_cache", "dist", "build"):
                continue
            digest.update(str(rel).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- environments


def uv_command() -> list[str] | None:
    uv = shutil.which("uv")
    return [uv] if uv else None


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def build_env(
    role: Role, env: Path, packages: dict[str, Path], *, python: str, fresh: bool
) -> tuple[list[str], bool]:
    """Create (or reuse) the role's environment; returns (its RLAX packages, reused?)."""
    names = closure(role.package, packages)
    uv = uv_command()
    installer = uv or ["pip"]
    stamp = fingerprint(names, packages, python, installer)
    stamp_file = env / ".rlax-node-installs"
    if (
        not fresh
        and stamp_file.is_file()
        and stamp_file.read_text() == stamp
        and subprocess.run([env_python(env), "-c", "pass"], capture_output=True).returncode == 0
    ):
        return names, True
    if env.exists():
        shutil.rmtree(env)
    folders = [str(packages[n]) for n in names]  # absolute paths: never a registry name
    if uv:
        subprocess.run([*uv, "venv", "--quiet", "--python", python, str(env)], check=True)
        # uv caches a local folder's built wheel keyed on its pyproject; refresh ours so a
        # changed source file is always rebuilt.
        refresh = [arg for n in names for arg in ("--refresh-package", n)]
        command = [*uv, "pip", "install", "--quiet", "--python", str(env_python(env)), *refresh, *folders]
    else:
        subprocess.run([python, "-m", "venv", str(env)], check=True)
        command = [str(env_python(env)), "-m", "pip", "install", "--quiet", "--no-cache-dir", *folders]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise Failure(f"{role.name}: installing {', '.join(names)} failed:\n{result.stdout}{result.stderr}")
    stamp_file.write_text(stamp)
    return names, False


_INSPECT = r"""
import importlib.metadata as m, json, sysconfig
dists = {}
for d in m.distributions():
    name = d.metadata["Name"]
    if not name:
        continue
    text = d.read_text("direct_url.json")
    editable = bool(text and json.loads(text).get("dir_info", {}).get("editable"))
    dists[name] = {"version": d.version, "editable": editable}
print(json.dumps({"dists": dists, "purelib": sysconfig.get_paths()["purelib"]}))
"""


def inspect_env(env: Path) -> tuple[dict[str, dict[str, object]], Path]:
    out = subprocess.run([env_python(env), "-c", _INSPECT], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    return {normalize(k): v for k, v in data["dists"].items()}, Path(data["purelib"])


def tree_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


# --------------------------------------------------------------------------- checks


def run_checked(command: list[str], *, expect: int = 0, timeout: float = 300, cwd: Path | None = None) -> str:
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **CPU_ENV}, cwd=cwd
    )
    if result.returncode != expect:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise Failure(f"`{' '.join(command)}` exited {result.returncode}, expected {expect}:\n{tail}")
    return result.stdout + result.stderr


def port_answers(address: str) -> bool:
    match = re.fullmatch(r"tcp://([^:]+):(\d+)", address.strip())
    if not match:
        raise Failure(f"not a bound TCP address: {address!r}")
    with socket.create_connection((match.group(1), int(match.group(2))), timeout=5):
        return True


def stop_server(process: subprocess.Popen[str], what: str, timeout: float = 30) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise Failure(f"{what} did not stop within {timeout:.0f}s of SIGTERM") from None
    if code != 0:
        raise Failure(f"{what} exited {code} on SIGTERM, expected 0")


def check_paramserver(env: Path, work: Path) -> str:
    ready = work / "paramserver.ready"
    ready.unlink(missing_ok=True)
    command = [
        str(env / "bin" / "rlax-paramserver"),
        "--bind",
        "tcp://127.0.0.1:*",
        "--ready-file",
        str(ready),
        "--state-dir",
        str(work / "paramserver-state"),
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **CPU_ENV}
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if process.poll() is not None:
                output = process.stdout.read() if process.stdout else ""
                raise Failure(f"rlax-paramserver exited {process.returncode} before serving:\n{output}")
            if time.monotonic() > deadline:
                raise Failure("rlax-paramserver wrote no --ready-file within 60s")
            time.sleep(0.1)
        address = ready.read_text().strip()
        port_answers(address)
        stop_server(process, "rlax-paramserver")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return f"rlax-paramserver served on {address}, stopped on SIGTERM (exit 0)"


def check_verifier(env: Path, work: Path) -> str:
    exe = str(env / "bin" / "rlax-verifier")
    help_text = run_checked([exe, "--help"])
    ready = work / "verifier.ready"
    ready.unlink(missing_ok=True)
    command = [exe, "--bind", "tcp://127.0.0.1:*"]
    if "--ready-file" in help_text:
        command += ["--ready-file", str(ready)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **CPU_ENV}
    )
    try:
        if "--ready-file" in command:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise Failure(f"rlax-verifier wrote no --ready-file (exit {process.poll()})")
                time.sleep(0.1)
            address = ready.read_text().strip()
        else:
            # Without --ready-file the bound address is the first line on stdout.
            address = process.stdout.readline().strip()  # type: ignore[union-attr]
            if not address:
                raise Failure(f"rlax-verifier printed no bound address (exit {process.wait()})")
        port_answers(address)
        stop_server(process, "rlax-verifier")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return f"rlax-verifier served on {address}, stopped on SIGTERM (exit 0)"


def demo_overrides(work: Path) -> list[str]:
    """The demo config as a worker started by hand sees it: its addresses written out."""
    return [
        f"run.output_dir={work / 'check-run'}",
        'workers.addresses=["tcp://127.0.0.1:47101", "tcp://127.0.0.1:47102"]',
    ]


def check_component(env: Path, role: Role, work: Path) -> str:
    config = ["--config", str(DEMO_CONFIG), *demo_overrides(work), "--check-config"]
    if role.name == "trainer":
        command = [str(env / "bin" / "rlax-trainer"), *config]
    elif role.name == "worker":
        command = [str(env / "bin" / "rlax-worker"), *config, "--index", "0"]
    else:
        command = [str(env / "bin" / "rlax"), "controller", *config]
    run_checked(command, cwd=work)
    return (
        f"`{Path(command[0]).name}{' controller' if role.name == 'controller' else ''} --check-config` exit 0"
    )


def check_front_door(env: Path, installed: set[str], work: Path) -> list[str]:
    """`rlax ROLE` for each component not installed here: exit 69, naming its package."""
    rlax = env / "bin" / "rlax"
    if not rlax.exists():
        if "rlax-core" in installed:
            raise Failure("rlax-core is installed but the `rlax` command is missing")
        return ["no `rlax` front door (rlax-core not installed)"]
    notes = []
    for other in ROLES:
        if other.package in installed:
            continue
        out = run_checked(
            [str(rlax), other.name, "--config", str(DEMO_CONFIG)], expect=EXIT_MISSING_COMPONENT, cwd=work
        )
        if f"pip install {other.package}" not in out:
            raise Failure(
                f"`rlax {other.name}` exited 69 without naming `pip install {other.package}`:\n{out}"
            )
        notes.append(f"rlax {other.name} -> 69, pip install {other.package}")
    return notes


def check_env(role: Role, env: Path, names: list[str], work: Path) -> dict[str, object]:
    dists, purelib = inspect_env(env)
    leaked = sorted(d for d in role.forbidden if normalize(d) in dists)
    if leaked:
        raise Failure(f"{role.name}: forbidden distributions installed: {', '.join(leaked)}")
    rlax_installed = {n for n in dists if is_rlax(n)}
    if rlax_installed != set(names):
        raise Failure(
            f"{role.name}: RLAX packages {sorted(rlax_installed)}, expected exactly {sorted(names)}"
        )
    editable = sorted(n for n in rlax_installed if dists[n]["editable"])
    if editable:
        raise Failure(f"{role.name}: installed editable (must be built from the checkout): {editable}")
    work.mkdir(parents=True, exist_ok=True)
    if role.name == "paramserver":
        started = check_paramserver(env, work)
    elif role.name == "verifier":
        started = check_verifier(env, work)
    else:
        started = check_component(env, role, work)
    doors = check_front_door(env, rlax_installed, work)
    return {
        "role": role.name,
        "package": role.package,
        "rlax": names,
        "distributions": len(dists),
        "size_mb": tree_bytes(purelib) / 1e6,
        "started": started,
        "front_door": doors,
        "absent": list(role.forbidden),
    }


# --------------------------------------------------------------------------- demo


def train_records(path: Path) -> list[dict[str, object]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train":
            records.append(record)
    return sorted(records, key=lambda r: int(r["step"]))  # type: ignore[arg-type]


def launch_demo(
    launcher: list[str], output: Path, overrides: list[str], log_path: Path, timeout: float
) -> float:
    command = [*launcher, "launch", str(DEMO_CONFIG), *overrides, f"run.output_dir={output}", "--overwrite"]
    start = time.monotonic()
    with open(log_path, "w") as handle:
        process = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **CPU_ENV}, cwd=output.parent
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)  # the launcher stops its components
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise Failure(
                f"`{' '.join(command)}` did not finish in {timeout:.0f}s (logs in {output})"
            ) from None
    elapsed = time.monotonic() - start
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise Failure(
            f"`{' '.join(command)}` exited {code} after {elapsed:.0f}s (logs in {output}):\n{tail}"
            + "".join(f"\n{line}" for line in last_errors(output / "logs"))
        )
    return elapsed


def last_errors(logs: Path) -> list[str]:
    """The last exception line of each component log that has one."""
    found = []
    for path in sorted(logs.glob("*.log")):
        errors = [
            line
            for line in path.read_text(errors="replace").splitlines()
            if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)
        ]
        if errors:
            found.append(f"{path.name}: {errors[-1]}")
    return found


def rewards(records: list[dict[str, object]]) -> list[float]:
    return [float(r["reward_mean"]) for r in records]  # type: ignore[arg-type]


def comparable_config(path: Path, *paths: Path) -> list[str]:
    """The resolved run config without what must differ between the runs: addresses,
    folders and interpreters."""
    lines = path.read_text().splitlines()
    return [
        line
        for line in lines
        if "tcp://" not in line and "interpreters:" not in line and not any(str(p) in line for p in paths)
    ]


def demo(
    envs: dict[str, Path],
    steps: int,
    reference: Path | None,
    tolerance: float,
    keep: Path | None,
    cache: Path,
    extra: list[str],
    timeout: float,
    require_identical: bool,
) -> None:
    window = max(1, min(10, steps // 3))
    # Both runs share one JAX compilation cache (kept between invocations): compiling, not
    # training, is most of a short run's time on a small CPU machine.
    overrides = [
        f"run.steps={steps}",
        "verifier.mode=service",
        f"run.jax_cache_dir={cache}",
        *DEMO_EXTRA,
        *extra,
    ]
    tmp = Path(tempfile.mkdtemp(prefix="rlax-node-demo-", dir=keep))
    interpreters = [f"supervisor.interpreters.{r}={env_python(e)}" for r, e in envs.items()]
    runs = {
        "five environments": (
            [str(envs["controller"] / "bin" / "rlax")],
            tmp / "five",
            [*overrides, *interpreters],
        )
    }
    if reference is None or not reference.exists():
        log(f"demo: no single-environment reference ({reference} missing): that comparison is SKIPPED")
    else:
        runs["one environment"] = ([str(reference), "-m", "rlax_core.cli"], tmp / "single", overrides)
    # Both runs at once: at k=0 a run's trajectory does not depend on timing, and two runs
    # share the 2-core machine's idle time (start-up, compilation waits) well.
    log(f"demo: {steps} steps, every component from its own environment (output {tmp / 'five'}), "
        f"and {'the same from one environment, side by side' if len(runs) > 1 else 'no reference'}")  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        futures = {
            name: pool.submit(launch_demo, launcher, out, args, out.with_suffix(".log"), timeout)
            for name, (launcher, out, args) in runs.items()
        }
        timings = {name: future.result() for name, future in futures.items()}
    resolved = (tmp / "five" / "config.yaml").read_text()
    missing = [r for r, e in envs.items() if str(env_python(e)) not in resolved]
    if missing:
        raise Failure(f"the five-environment run's config names no interpreter for {missing}")
    five = train_records(tmp / "five" / "metrics.jsonl")
    single: list[dict[str, object]] = []
    if "one environment" in runs:
        single = train_records(tmp / "single" / "metrics.jsonl")
        envs_root = next(iter(envs.values())).parent
        a = comparable_config(tmp / "five" / "config.yaml", tmp, envs_root, cache)
        b = comparable_config(tmp / "single" / "config.yaml", tmp, envs_root, cache)
        if a != b:
            diff = [f"- {x}" for x in a if x not in b] + [f"+ {x}" for x in b if x not in a]
            raise Failure("the two runs' resolved configs differ:\n" + "\n".join(diff))
    for name, seconds in timings.items():
        log(f"demo timing: {name}: {seconds:.1f}s")
    if len(five) < steps:
        raise Failure(f"five-environment run logged {len(five)} train steps, expected {steps}")
    r5 = rewards(five)
    print(f"\n{'step':>4}  {'reward (5 envs)':>15}  {'reward (1 env)':>14}")
    r1 = rewards(single)
    for i, record in enumerate(five):
        other = f"{r1[i]:14.3f}" if i < len(r1) else f"{'-':>14}"
        print(f"{int(record['step']):4d}  {r5[i]:15.3f}  {other}")  # type: ignore[call-overload]
    first5, last5 = statistics.fmean(r5[:window]), statistics.fmean(r5[-window:])
    log(f"demo: 5 envs: reward first {window} steps {first5:.3f}, last {window} steps {last5:.3f}")
    if not last5 > first5:
        raise Failure(
            f"five-environment run did not learn: last {window} {last5:.3f} <= first {window} {first5:.3f}"
        )
    if single:
        first1, last1 = statistics.fmean(r1[:window]), statistics.fmean(r1[-window:])
        identical = r1 == r5
        log(
            f"demo: 1 env : reward first {window} steps {first1:.3f}, last {window} steps {last1:.3f}; "
            f"trajectories {'IDENTICAL' if identical else 'differ (asynchronous run: timing decides staleness)'}"
        )
        if require_identical and not identical:
            raise Failure("--require-identical: the two runs' training rewards differ")
        if abs(last5 - last1) > tolerance:
            raise Failure(
                f"five-environment run ends at {last5:.3f}, the single-environment run at {last1:.3f}: "
                f"more than the tolerance {tolerance}"
            )
    if keep is None:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        log(f"demo: runs kept in {tmp}")


# Settings both demo runs share beyond `run.steps`. No evaluation: at the start and the end
# it costs about as much as the 30 steps on a 2-core machine, and the check reads the
# training reward. Synchronous training (k=0): the demo's k=2 lets timing decide which
# weights version a rollout comes from, so two correct runs drift apart after a few
# steps; at k=0 the same config and seed give the same trajectory wherever each
# component runs, which is the strongest comparison (`--demo-override trainer.k=2` for
# the demo's own asynchrony, compared within --tolerance).
DEMO_EXTRA: list[str] = ["eval.num_prompts=0", "trainer.k=0"]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / ".nox" / "node-envs", help="folder of the environments"
    )
    parser.add_argument(
        "--roles", nargs="*", default=[r.name for r in ROLES], help="roles to build and check"
    )
    parser.add_argument("--fresh", action="store_true", help="recreate every environment")
    parser.add_argument("--python", default=sys.executable, help="interpreter the environments are made from")
    parser.add_argument(
        "--demo-steps", type=int, default=0, help="run the demo for N steps from the environments"
    )
    parser.add_argument(
        "--reference-python",
        type=Path,
        default=ROOT / ".nox" / "tests" / "bin" / "python",
        help="a single environment with every package (the demo's comparison run)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.1, help="|final reward(5 envs) - (1 env)| allowed"
    )
    parser.add_argument("--keep-runs", type=Path, help="keep the demo runs under this folder")
    parser.add_argument(
        "--demo-override",
        action="append",
        default=[],
        metavar="key=value",
        help="a dotted override for both demo runs (repeatable), e.g. trainer.k=2",
    )
    parser.add_argument("--demo-timeout", type=float, default=900, help="seconds for each demo run")
    parser.add_argument(
        "--require-identical",
        action="store_true",
        help="fail unless both demo runs log the same training reward at every step",
    )
    args = parser.parse_args(argv)

    unknown = set(args.roles) - {r.name for r in ROLES}
    if unknown:
        parser.error(f"unknown roles {sorted(unknown)}")
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    timings: list[tuple[str, float]] = []
    rows: list[dict[str, object]] = []
    envs: dict[str, Path] = {}
    try:
        packages = local_packages()
        log(f"installer: {'uv' if uv_command() else 'venv + pip'}; environments under {out}")
        for role in ROLES:
            if role.name not in args.roles:
                continue
            env = out / role.name
            t0 = time.monotonic()
            names, reused = build_env(role, env, packages, python=args.python, fresh=args.fresh)
            t1 = time.monotonic()
            with tempfile.TemporaryDirectory(prefix=f"rlax-node-{role.name}-") as work:
                row = check_env(role, env, names, Path(work))
            t2 = time.monotonic()
            row["install_s"], row["check_s"], row["reused"] = t1 - t0, t2 - t1, reused
            rows.append(row)
            envs[role.name] = env
            timings += [
                (f"{role.name}: {'reuse' if reused else 'install'}", t1 - t0),
                (f"{role.name}: checks", t2 - t1),
            ]
            log(f"{role.name}: ok ({row['started']}; {'; '.join(row['front_door'])})")  # type: ignore[arg-type]
        print_table(rows)
        if args.demo_steps:
            if set(envs) != {r.name for r in ROLES}:
                raise Failure("--demo-steps needs all five roles")
            t0 = time.monotonic()
            demo(
                envs,
                args.demo_steps,
                args.reference_python,
                args.tolerance,
                args.keep_runs,
                out / "jax-cache",
                args.demo_override,
                args.demo_timeout,
                args.require_identical,
            )
            timings.append(("demo (both runs)", time.monotonic() - t0))
    except Failure as failure:
        print(f"\nnode_installs FAILED: {failure}", file=sys.stderr, flush=True)
        return 1
    finally:
        timings.append(("total", time.monotonic() - started))
        print("\ntimings:")
        for name, seconds in timings:
            print(f"  {name:<28} {seconds:7.1f}s")
    print("\nnode_installs: ok")
    return 0


def print_table(rows: list[dict[str, object]]) -> None:
    print(f"\n{'role':<12} {'package':<17} {'dists':>5} {'site-packages MB':>16}  RLAX packages")
    for row in rows:
        rlax = ", ".join(str(n).removeprefix("rlax-") for n in row["rlax"])  # type: ignore[attr-defined]
        print(
            f"{row['role']:<12} {row['package']:<17} {row['distributions']:>5} {row['size_mb']:>16.1f}  {rlax}"
        )
    print()


if __name__ == "__main__":
    sys.exit(main())
