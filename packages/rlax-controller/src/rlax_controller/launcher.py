"""`rlax launch`: validate the config (the run config, then every component's own typed
config: `preflight`), resolve addresses, start and supervise every component as a local
process, show progress, and summarise the run at the end."""

from __future__ import annotations

import pathlib
import shutil
import socket
import sys
from typing import Any

import msgspec
from rich.console import Console

from rlax_controller.metrics import ProgressDisplay, plot_run, read_metrics, summary_table
from rlax_controller.preflight import validate_components
from rlax_controller.supervisor import ProcessSpec, Supervisor, SupervisorReport
from rlax_core.addresses import ADDRESS_BOOK, server_addresses, write_address_book
from rlax_core.config import AUTO, EXIT_CONFIG_ERROR, RunConfig, dump_config, load_config, paramserver_dirs
from rlax_protocol.auth import INSECURE_ENV, RunKeys

__all__ = ["build_specs", "launch", "resolve_addresses", "run_keys"]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def resolve_addresses(config: RunConfig) -> RunConfig:
    """Replace every `auto` address by a free loopback (or `addresses.host`) TCP port (and
    a multi-host trainer's `auto` coordinator by HOST:PORT)."""
    host = config.addresses.host

    def pick(address: str) -> str:
        return f"tcp://{host}:{_free_port(host)}" if address == AUTO else address

    workers = list(config.workers.addresses) or [AUTO] * config.workers.count
    coordinator = config.trainer.coordinator
    if coordinator == AUTO and config.trainer.hosts > 1:
        coordinator = f"{host}:{_free_port(host)}"
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


def _rlax(config: RunConfig, role: str, *args: str) -> list[str]:
    # The front door of the role's environment runs whichever component is installed there.
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
    """The processes of a local run, in start order (servers before their clients), each
    with its role's credential from `keys` (give the same keys for the whole run: a
    restarted process must present what the others accept; None: ``security.insecure``)."""
    path = str(config_path)
    specs = [
        ProcessSpec("paramserver", "paramserver", _paramserver_command(config), _role_env(keys, "server"))
    ]
    if config.verifier.mode == "service":
        command = _rlax(config, "verifier", "--bind", config.verifier.address)
        if config.agent.where == "service" and ":" in config.agent.environment:
            command += ["--environment", config.agent.environment]  # a user's module path
        specs.append(ProcessSpec("verifier", "verifier", command, _role_env(keys, "server")))
    for i in range(config.workers.count):
        command = _rlax(config, "worker", "--config", path, "--index", str(i))
        specs.append(ProcessSpec(f"worker{i}", "worker", command, _role_env(keys, "worker")))
    hosts = config.trainer.hosts
    if hosts == 1:
        command = _rlax(config, "trainer", "--config", path)
        specs.append(ProcessSpec("trainer", "trainer", command, _role_env(keys, "trainer")))
    for i in range(hosts if hosts > 1 else 0):  # one gang, joined by jax.distributed
        command = _rlax(config, "trainer", "--config", path, "--process-id", str(i))
        specs.append(
            ProcessSpec(f"trainer{i}", "trainer", command, _role_env(keys, "trainer"), gang="trainer")
        )
    command = _rlax(config, "controller", "--config", path)
    specs.append(
        ProcessSpec("controller", "controller", command, _role_env(keys, "controller"), completes_run=True)
    )
    return specs


class _MetricsTail:
    """Feeds new lines of metrics.jsonl to the progress display."""

    def __init__(self, path: pathlib.Path, display: ProgressDisplay) -> None:
        self.path = path
        self.display = display
        self.offset = 0

    def __call__(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        for line in chunk[: end + 1].splitlines():
            try:
                record: dict[str, Any] = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            if record.get("kind") in ("train", "eval"):
                self.display.update(record)


def launch(
    config_path: str | pathlib.Path | None,
    overrides: list[str] | None = None,
    *,
    overwrite: bool = False,
    console: Console | None = None,
) -> SupervisorReport:
    """Run a whole RL job locally (or on Ray with `launcher.backend: ray`). Raises `ConfigError` before anything starts (or is
    written) on a config that the run config or any component rejects."""
    console = console or Console()
    config = load_config(config_path, overrides)
    if config.launcher.backend == "ray":
        from rlax_controller import ray_launcher  # imports ray: the optional extra

        return ray_launcher.launch(config_path, overrides, overwrite=overwrite, console=console)
    config = resolve_addresses(config)
    validate_components(config)
    output = config.output_dir
    if overwrite and output.exists():
        shutil.rmtree(output)
    resumed = (output / "snapshots").is_dir()
    output.mkdir(parents=True, exist_ok=True)
    # The address book: clients read a server's address there when they reconnect (the Ray
    # launcher moves servers; here the addresses stay, and the clients take the same path).
    book = output.resolve() / ADDRESS_BOOK
    config = msgspec.structs.replace(
        config, addresses=msgspec.structs.replace(config.addresses, book=str(book))
    )
    write_address_book(book, server_addresses(config))
    resolved = dump_config(config, output / "config.yaml")
    console.print(
        f"[bold]RLAX[/bold] run [cyan]{config.run.name}[/cyan] in {output} "
        f"({'resuming' if resumed else 'new'}; {config.workers.count} workers, j={config.workers.j}, "
        f"k={config.trainer.k}, preset {config.trainer.preset}"
        + (f", chaos every ~{config.chaos.interval:g}s" if config.chaos.interval else "")
        + ")"
    )
    display = ProgressDisplay(config.run.steps)
    tail = _MetricsTail(output / "metrics.jsonl", display)
    specs = build_specs(config, resolved, run_keys(config))
    supervisor = Supervisor(specs, output / "logs", config.supervisor, config.chaos)
    try:
        report = supervisor.run(on_tick=tail)
    finally:
        tail()
        display.close()
    summarise(console, config, output, report)
    return report


def summarise(console: Console, config: RunConfig, output: pathlib.Path, report: SupervisorReport) -> None:
    """The end of a run, whichever launcher ran it: summary table, plot, then the report."""
    records = read_metrics(output / "metrics.jsonl")
    if any(r.get("kind") in ("train", "eval") for r in records):
        console.print(summary_table(records, title=f"RLAX run {config.run.name}"))
        plot = plot_run(records, output / "summary.png", title=f"RLAX run {config.run.name}")
        console.print(f"plot: {plot}")
    console.print(report.render())


def main(argv: list[str] | None = None) -> int:
    """`rlax launch CONFIG [key=value ...] [--overwrite]`."""
    import argparse

    from rlax_core.cli import setup_logging
    from rlax_core.config import ConfigError

    parser = argparse.ArgumentParser(
        prog="rlax launch", description="run every component locally, supervised"
    )
    parser.add_argument("config", help="run config YAML")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. chaos.interval=5"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="delete the run's output folder first (else resume)"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_intermixed_args(argv)  # `CONFIG --overwrite k=v` as well as `--overwrite CONFIG k=v`
    setup_logging(args.log_level)
    try:
        report = launch(args.config, list(args.overrides), overwrite=args.overwrite)
    except ConfigError as error:
        print(f"rlax launch: invalid config: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if report.config_error:
        return EXIT_CONFIG_ERROR
    return 0 if report.success else 1
