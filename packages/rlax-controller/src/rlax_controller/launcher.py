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

from rlax_controller.config import AUTO, RunConfig, dump_config, load_config
from rlax_controller.metrics import ProgressDisplay, plot_run, read_metrics, summary_table
from rlax_controller.preflight import validate_components
from rlax_controller.supervisor import ProcessSpec, Supervisor, SupervisorReport

__all__ = ["build_specs", "launch", "resolve_addresses"]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def resolve_addresses(config: RunConfig) -> RunConfig:
    """Replace every `auto` address by a free loopback (or `addresses.host`) TCP port."""
    host = config.addresses.host

    def pick(address: str) -> str:
        return f"tcp://{host}:{_free_port(host)}" if address == AUTO else address

    workers = list(config.workers.addresses) or [AUTO] * config.workers.count
    return msgspec.structs.replace(
        config,
        controller=msgspec.structs.replace(config.controller, address=pick(config.controller.address)),
        paramserver=msgspec.structs.replace(config.paramserver, address=pick(config.paramserver.address)),
        verifier=msgspec.structs.replace(config.verifier, address=pick(config.verifier.address)),
        workers=msgspec.structs.replace(config.workers, addresses=[pick(a) for a in workers]),
    )


def _rlax(*args: str) -> list[str]:
    # The same interpreter, so a launch from a virtualenv runs its components there too.
    return [sys.executable, "-m", "rlax_controller.cli", *args]


def build_specs(config: RunConfig, config_path: pathlib.Path) -> list[ProcessSpec]:
    """The processes of a local run, in start order (servers before their clients)."""
    path = str(config_path)
    env = {"PYTHONUNBUFFERED": "1"}
    specs = [ProcessSpec("paramserver", "paramserver", _rlax("paramserver", "--config", path), env)]
    if config.verifier.mode == "service":
        specs.append(ProcessSpec("verifier", "verifier", _rlax("verifier", "--config", path), env))
    for i in range(config.workers.count):
        specs.append(
            ProcessSpec(f"worker{i}", "worker", _rlax("worker", "--config", path, "--index", str(i)), env)
        )
    specs.append(ProcessSpec("trainer", "trainer", _rlax("trainer", "--config", path), env))
    specs.append(
        ProcessSpec(
            "controller", "controller", _rlax("controller", "--config", path), env, completes_run=True
        )
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
    """Run a whole RL job locally. Raises `ConfigError` before anything starts (or is
    written) on a config that the run config or any component rejects."""
    console = console or Console()
    config = resolve_addresses(load_config(config_path, overrides))
    validate_components(config)
    output = config.output_dir
    if overwrite and output.exists():
        shutil.rmtree(output)
    resumed = (output / "snapshots").is_dir()
    output.mkdir(parents=True, exist_ok=True)
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
    supervisor = Supervisor(build_specs(config, resolved), output / "logs", config.supervisor, config.chaos)
    try:
        report = supervisor.run(on_tick=tail)
    finally:
        tail()
        display.close()
    records = read_metrics(output / "metrics.jsonl")
    if any(r.get("kind") in ("train", "eval") for r in records):
        console.print(summary_table(records, title=f"RLAX run {config.run.name}"))
        plot = plot_run(records, output / "summary.png", title=f"RLAX run {config.run.name}")
        console.print(f"plot: {plot}")
    console.print(report.render())
    return report
