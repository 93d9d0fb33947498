"""How a run ended, whichever backend ran it: the report `rlax launch` prints and returns."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

__all__ = ["RayReport", "SupervisorReport", "UnplannedRestart"]


@dataclasses.dataclass(frozen=True)
class UnplannedRestart:
    """An exit that neither chaos nor the run's end explains: which process, its exit code
    (negative: the signal that killed it), and the end of that life's log (its traceback)."""

    name: str
    role: str
    code: int
    log_tail: str

    def describe(self) -> str:
        how = f"killed by signal {-self.code}" if self.code < 0 else f"exited with code {self.code}"
        tail = self.log_tail.strip() or "(its log of that life is empty)"
        indented = "\n".join(f"    {line}" for line in tail.splitlines())
        return f"{self.name} ({self.role}) {how}; the end of its log:\n{indented}"


@dataclasses.dataclass
class SupervisorReport:
    """How a run ended. `config_error`: a component rejected its config (exit code
    `EXIT_CONFIG_ERROR`) or is not installed; `reason` then carries that component's message.
    `unplanned_restarts`: every exit that was not a chaos kill nor the run's end, in order."""

    success: bool
    reason: str
    restarts: dict[str, int]
    chaos_kills: list[tuple[str, str]]
    exit_codes: dict[str, list[int]]
    log_dir: pathlib.Path
    config_error: bool = False
    unplanned_restarts: list[UnplannedRestart] = dataclasses.field(default_factory=list)

    def render(self) -> str:
        lines = [f"run {'finished' if self.success else 'stopped'}: {self.reason}"]
        for name, count in sorted(self.restarts.items()):
            codes = ", ".join(str(c) for c in self.exit_codes.get(name, [])[-5:])
            lines.append(f"  {name}: {count} restart(s); last exit codes [{codes}]")
        if self.chaos_kills:
            lines.append(
                f"  chaos kills: {len(self.chaos_kills)} ({', '.join(n for n, _ in self.chaos_kills)})"
            )
        if self.unplanned_restarts:
            names = ", ".join(f"{u.name} (code {u.code})" for u in self.unplanned_restarts)
            lines.append(f"  unplanned exits: {len(self.unplanned_restarts)} ({names})")
        lines.append(f"  logs: {self.log_dir}")
        return "\n".join(lines)


@dataclasses.dataclass
class RayReport(SupervisorReport):
    """The local report, and the stall of every node lost during the run (`node_lost`
    records: `stall_s` from the loss to every replacement serving, `detect_s` until Ray
    gave the node up) and the cluster's health-check timing."""

    stalls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    health_check: str = ""

    def render(self) -> str:
        lines = [super().render()]
        for stall in self.stalls:
            lines.append(
                f"  {stall['event'].replace('_', ' ')} {stall['node'][:8]} ({', '.join(stall['processes'])}): "
                f"{stall['stall_s']:.1f}s from the loss to its replacements serving, "
                f"{stall['detect_s']:.1f}s of it until Ray gave the node up"
            )
        if self.health_check:
            lines.append(f"  ray health check: {self.health_check}")
        return "\n".join(lines)
