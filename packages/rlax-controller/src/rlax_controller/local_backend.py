"""The local backend of `rlax launch` (`launcher.backend: local`): every component as a
process of this machine under `supervisor.Supervisor`."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from rlax_controller.process_plan import build_specs, resolve_addresses
from rlax_controller.run_report import SupervisorReport
from rlax_controller.supervisor import Supervisor
from rlax_core.config import RunConfig
from rlax_protocol.auth import RunKeys

__all__ = ["LocalBackend"]


class LocalBackend:
    """`launcher.Backend` on this machine: one supervised process per component."""

    where = ""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.output = config.output_dir
        self.keys: RunKeys | None = None

    def plan(self, config: RunConfig) -> RunConfig:
        """Every `auto` address becomes a free port of this machine."""
        return resolve_addresses(config)

    def place(self, config: RunConfig, output: pathlib.Path, keys: RunKeys | None) -> RunConfig:
        """Nothing to place: the processes start here, on the addresses planned."""
        self.config, self.output, self.keys = config, output, keys
        return config

    def supervise(self, resolved: pathlib.Path, on_tick: Callable[[], None]) -> SupervisorReport:
        """Start every process in order and supervise them until the run ends (SIGINT and
        SIGTERM stop the run: the supervisor's own handlers)."""
        specs = build_specs(self.config, resolved, self.keys)
        supervisor = Supervisor(specs, self.output / "logs", self.config.supervisor, self.config.chaos)
        return supervisor.run(on_tick=on_tick)

    def interrupted(self, why: str, log_dir: pathlib.Path) -> SupervisorReport:
        return SupervisorReport(False, why, {}, [], {}, log_dir)

    def stop_all(self) -> None:
        """Nothing left: the supervisor stops every process before it returns."""
