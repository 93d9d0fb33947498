"""`rlax launch`: validate the config (the run config, then every component's own typed
config: `preflight`), plan every process's address, write the resolved config and the
address book, start and supervise every component with the run's backend (`local`: local
processes, `ray`: Ray actors), show progress, and summarise the run at the end.

The launch sequence is written once, here; a backend (`Backend`) says where the processes
run: `local_backend.LocalBackend` or `ray_backend.RayBackend`. Both restart by the one
policy of `restart_policy`.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from rich.console import Console

from rlax_controller.local_backend import LocalBackend
from rlax_controller.metrics import ProgressDisplay, plot_run, read_metrics, summary_table
from rlax_controller.preflight import validate_components
from rlax_controller.process_plan import resolve_addresses, run_keys, write_run_files
from rlax_controller.run_report import SupervisorReport
from rlax_core.addresses import ADDRESS_BOOK
from rlax_core.config import EXIT_CONFIG_ERROR, RunConfig, load_config
from rlax_protocol.auth import RunKeys

__all__ = ["Backend", "MetricsTail", "backend_for", "launch", "main", "summarise"]


class Backend(Protocol):
    """Where a run's processes run. The launch sequence calls, in order: `plan` (the
    addresses known before anything starts), `place` (reserve where each process runs: the
    config with every address), `supervise` (start every process in order, restart by
    `restart_policy`, until the run ends) and, whatever happened, `stop_all`."""

    where: str  # how the banner says where the run is (empty: this machine)

    def plan(self, config: RunConfig) -> RunConfig: ...

    def place(self, config: RunConfig, output: pathlib.Path, keys: RunKeys | None) -> RunConfig: ...

    def supervise(self, resolved: pathlib.Path, on_tick: Callable[[], None]) -> SupervisorReport: ...

    def interrupted(self, why: str, log_dir: pathlib.Path) -> SupervisorReport: ...

    def stop_all(self) -> None: ...


def backend_for(config: RunConfig) -> Backend:
    """The backend `launcher.backend` names; the Ray one fails here, as a config error, when
    its cluster does not answer or Ray is not installed."""
    if config.launcher.backend == "ray":
        from rlax_controller.ray_backend import RayBackend  # imports ray: the optional extra

        return RayBackend(config)
    return LocalBackend(config)


class MetricsTail:
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


def _banner(config: RunConfig, output: pathlib.Path, resumed: bool, where: str) -> str:
    return (
        f"[bold]RLAX[/bold] run [cyan]{config.run.name}[/cyan]{where} in {output} "
        f"({'resuming' if resumed else 'new'}; {config.workers.count} workers, j={config.workers.j}, "
        f"k={config.trainer.k}, preset {config.trainer.preset}"
        + (f", trainer gang of {config.trainer.hosts}" if config.trainer.hosts > 1 else "")
        + (f", chaos every ~{config.chaos.interval:g}s" if config.chaos.interval else "")
        + ")"
    )


def launch(
    config_path: str | pathlib.Path | None,
    overrides: list[str] | None = None,
    *,
    overwrite: bool = False,
    console: Console | None = None,
) -> SupervisorReport:
    """Run a whole RL job with the backend `launcher.backend` names (local processes, or Ray
    actors). Raises `ConfigError` before anything starts (or is written) on a config that
    the run config or any component rejects."""
    console = console or Console()
    config = load_config(config_path, overrides)
    # The checks need every address; where the backend learns them only at placement (Ray),
    # free local ports stand in for them.
    validate_components(resolve_addresses(config))
    backend = backend_for(config)
    config = backend.plan(config)
    output = config.output_dir.resolve()
    if overwrite and output.exists():
        shutil.rmtree(output)
    resumed = (output / "snapshots").is_dir()
    output.mkdir(parents=True, exist_ok=True)
    # The address book: clients read a server's address there when they reconnect (the Ray
    # backend moves servers; the local one keeps them, and its clients take the same path).
    book = str(output / ADDRESS_BOOK)
    config = msgspec.structs.replace(config, addresses=msgspec.structs.replace(config.addresses, book=book))
    keys = run_keys(config)  # once per run: a restarted process presents what the others accept
    display: ProgressDisplay | None = None
    tail: MetricsTail | None = None
    try:
        config = backend.place(config, output, keys)
        resolved = write_run_files(config, output)
        console.print(_banner(config, output, resumed, backend.where))
        display = ProgressDisplay(config.run.steps)
        tail = MetricsTail(output / "metrics.jsonl", display)
        report = backend.supervise(resolved, tail)
    except KeyboardInterrupt as interrupt:
        report = backend.interrupted(f"interrupted ({interrupt or 'Ctrl-C'})", output / "logs")
    finally:
        if tail is not None:
            tail()
        if display is not None:
            display.close()
        backend.stop_all()
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
