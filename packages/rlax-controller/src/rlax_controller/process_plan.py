"""The processes of a run, whichever backend starts them: their addresses, command lines,
credentials and start order, and the files every process reads at start (the resolved
config and the address book)."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import msgspec

from rlax_core.addresses import server_addresses, write_address_book
from rlax_core.config import AUTO, RunConfig, dump_config, paramserver_dirs
from rlax_protocol.auth import INSECURE_ENV, RunKeys
from rlax_protocol.ports import reserve_port

__all__ = [
    "ProcessSpec",
    "build_specs",
    "python_of",
    "resolve_addresses",
    "rlax_command",
    "run_keys",
    "write_run_files",
]


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One component to run. `completes_run`: its clean exit (code 0) ends the whole run.
    `gang`: processes that share a gang name live and die together (a multi-host trainer
    joined by `jax.distributed`): when one exits, the others are stopped and all restart."""

    name: str
    role: str
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    completes_run: bool = False
    gang: str = ""


def resolve_addresses(config: RunConfig) -> RunConfig:
    """Replace every `auto` address by a free loopback (or `addresses.host`) TCP port (and
    a multi-host trainer's `auto` coordinator by HOST:PORT)."""
    host = config.addresses.host

    def pick(address: str) -> str:
        return f"tcp://{host}:{reserve_port(host)}" if address == AUTO else address

    workers = list(config.workers.addresses) or [AUTO] * config.workers.count
    coordinator = config.trainer.coordinator
    if coordinator == AUTO and config.trainer.hosts > 1:
        coordinator = f"{host}:{reserve_port(host)}"
    return msgspec.structs.replace(
        config,
        trainer=msgspec.structs.replace(config.trainer, coordinator=coordinator),
        controller=msgspec.structs.replace(config.controller, address=pick(config.controller.address)),
        paramserver=msgspec.structs.replace(config.paramserver, address=pick(config.paramserver.address)),
        verifier=msgspec.structs.replace(config.verifier, address=pick(config.verifier.address)),
        workers=msgspec.structs.replace(config.workers, addresses=[pick(a) for a in workers]),
    )


def python_of(config: RunConfig, role: str) -> str:
    """The interpreter that runs `role`: `supervisor.interpreters[role]`, else this one (so a
    launch from a virtualenv runs its components there too)."""
    return config.supervisor.interpreters.get(role, sys.executable)


def rlax_command(config: RunConfig, role: str, *args: str) -> list[str]:
    """`rlax ROLE ARGS` with the role's interpreter: the front door of the role's
    environment runs whichever component is installed there."""
    return [python_of(config, role), "-m", "rlax_core.cli", role, *args]


def _paramserver_command(config: RunConfig) -> list[str]:
    # A parameter-server node installs rlax-paramserver alone: its own entry point, no run config.
    state_dir, rest_dir = paramserver_dirs(config)
    flags = ["--bind", config.paramserver.address, "--keep", str(config.paramserver.keep)]
    if not config.paramserver.fsync:
        flags.append("--no-fsync")
    if rest_dir is not None:
        flags += ["--rest-dir", str(rest_dir)]
    return [python_of(config, "paramserver"), "-m", "rlax_paramserver", *flags, "--state-dir", str(state_dir)]


def run_keys(config: RunConfig) -> RunKeys | None:
    """Fresh secrets for one run (None with ``security.insecure``): PLAIN tokens when every
    address is loopback, CURVE key pairs otherwise (`rlax_protocol.auth`)."""
    if config.security.insecure:
        return None
    addresses = [
        config.controller.address,
        config.paramserver.address,
        config.verifier.address,
        *config.workers.addresses,
        f"tcp://{config.addresses.host}:0",
    ]
    return RunKeys.for_addresses(addresses)


def _role_env(keys: RunKeys | None, role: str) -> dict[str, str]:
    """The environment that gives one process its role's credential, and nothing more."""
    if keys is None:
        return {"PYTHONUNBUFFERED": "1", INSECURE_ENV: "1"}
    return {"PYTHONUNBUFFERED": "1", **keys.environment(role)}


def build_specs(config: RunConfig, config_path: pathlib.Path, keys: RunKeys | None) -> list[ProcessSpec]:
    """The processes of a run, in start order (servers before their clients), each with
    its role's credential from `keys` (give the same keys for the whole run: a restarted
    process must present what the others accept; None: ``security.insecure``)."""
    path = str(config_path)
    specs = [
        ProcessSpec("paramserver", "paramserver", _paramserver_command(config), _role_env(keys, "server"))
    ]
    if config.verifier.mode == "service":
        command = rlax_command(config, "verifier", "--bind", config.verifier.address)
        if config.agent.where == "service" and ":" in config.agent.environment:
            command += ["--environment", config.agent.environment]  # a user's module path
        specs.append(ProcessSpec("verifier", "verifier", command, _role_env(keys, "server")))
    for i in range(config.workers.count):
        command = rlax_command(config, "worker", "--config", path, "--index", str(i))
        specs.append(ProcessSpec(f"worker{i}", "worker", command, _role_env(keys, "worker")))
    hosts = config.trainer.hosts
    if hosts == 1:
        command = rlax_command(config, "trainer", "--config", path)
        specs.append(ProcessSpec("trainer", "trainer", command, _role_env(keys, "trainer")))
    for i in range(hosts if hosts > 1 else 0):  # one gang, joined by jax.distributed
        command = rlax_command(config, "trainer", "--config", path, "--process-id", str(i))
        specs.append(
            ProcessSpec(f"trainer{i}", "trainer", command, _role_env(keys, "trainer"), gang="trainer")
        )
    command = rlax_command(config, "controller", "--config", path)
    specs.append(
        ProcessSpec("controller", "controller", command, _role_env(keys, "controller"), completes_run=True)
    )
    return specs


def write_run_files(config: RunConfig, output: pathlib.Path) -> pathlib.Path:
    """Write the resolved config into the run folder and, into the address book, where
    every server listens now (clients read it when they reconnect: a server the Ray
    backend moves to another node is found there); the config's path."""
    resolved = dump_config(config, output / "config.yaml")
    known = {name: address for name, address in server_addresses(config).items() if address != AUTO}
    write_address_book(pathlib.Path(config.addresses.book), known)
    return resolved
