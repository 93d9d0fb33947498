"""When a component that exited is restarted, and when its exit stops the run: the one
policy of both launch backends (`supervisor.Supervisor` for local processes,
`ray_supervision.RaySupervision` for Ray actors).

- A clean exit (code 0) of the process that completes the run ends the run.
- `EXIT_CONFIG_ERROR` (the component rejected its config) and `EXIT_MISSING_COMPONENT`
  (the role's package is not installed in its environment) are never restarted: the same
  config, the same environment, would fail the same way; the run stops with the
  component's message.
- Any other exit is restarted after a back-off that doubles with each failure in a row
  (`supervisor.backoff_initial_s` up to `backoff_max_s`; a life longer than
  `stable_after_s` starts the count again), until more than `supervisor.max_restarts`
  failures. Exits the launcher caused itself (chaos kills, a gang stopped with its member,
  a restart for a move) are restarted at once and are not failures. On Ray, Ray restarts
  the actor; the budget applies where the role's `max_restarts` leaves it to us (-1).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib

from rlax_core.cli import EXIT_MISSING_COMPONENT
from rlax_core.config import EXIT_CONFIG_ERROR, SupervisorSection

__all__ = [
    "EXIT_MISSING_COMPONENT",
    "NEVER_RESTARTED",
    "UNPLANNED_TAIL_LINES",
    "ExitVerdict",
    "RestartPolicy",
    "log_part_tail",
    "log_tail",
]

# Exit codes that a restart would only repeat.
NEVER_RESTARTED = frozenset({EXIT_CONFIG_ERROR, EXIT_MISSING_COMPONENT})
# Lines of a life's log that an unplanned exit carries (a traceback and what led to it).
UNPLANNED_TAIL_LINES = 60
# How far back from a log's end a tail is read: a crash's last lines, not a whole day's log.
_TAIL_WINDOW_BYTES = 65536


class ExitVerdict(enum.Enum):
    """What one exit means for the run."""

    COMPLETED = "completed"  # the completing process exited cleanly: the run is done
    CONFIG_REJECTED = "config_rejected"  # EXIT_CONFIG_ERROR: stop, the same config fails again
    MISSING_COMPONENT = "missing_component"  # EXIT_MISSING_COMPONENT: stop, nothing to run
    RESTART = "restart"


def log_tail(path: pathlib.Path, lines: int = 15, *, offset: int = 0) -> str:
    """The last `lines` lines of `path` from byte `offset` on (one life's output)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def log_part_tail(path: pathlib.Path, start: int, end: int | None, lines: int = UNPLANNED_TAIL_LINES) -> str:
    """The last `lines` lines of `path` between byte `start` and `end` (None: its end)."""
    try:
        with open(path, "rb") as handle:
            stop = handle.seek(0, os.SEEK_END) if end is None else end
            handle.seek(max(start, stop - _TAIL_WINDOW_BYTES))
            text = handle.read(max(0, stop - handle.tell())).decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """`supervisor.*`'s limits, applied to one exit at a time."""

    limits: SupervisorSection

    @staticmethod
    def verdict(code: int, *, completes_run: bool, by_chaos: bool = False) -> ExitVerdict:
        """What the exit `code` of a process means (`by_chaos`: the launcher killed it)."""
        if completes_run and code == 0:
            return ExitVerdict.COMPLETED
        if by_chaos:
            return ExitVerdict.RESTART
        if code == EXIT_CONFIG_ERROR:
            return ExitVerdict.CONFIG_REJECTED
        if code == EXIT_MISSING_COMPONENT:
            return ExitVerdict.MISSING_COMPONENT
        return ExitVerdict.RESTART

    def over_budget(self, failures: int) -> bool:
        """Whether `failures` (this exit included; exits the launcher caused are none)
        are more than a run restarts."""
        return failures > self.limits.max_restarts

    def failure_streak(self, streak: int, lived_s: float) -> int:
        """Failures in a row once a life of `lived_s` seconds failed: a stable life (longer
        than `stable_after_s`) starts the count again."""
        return (0 if lived_s >= self.limits.stable_after_s else streak) + 1

    def backoff_s(self, streak: int, *, by_chaos: bool = False) -> float:
        """How long to wait before the restart after `streak` failures in a row; the
        launcher's own kills restart after the shortest wait."""
        if by_chaos:
            return self.limits.backoff_initial_s
        growth: int = 2 ** max(0, streak - 1)  # int ** int is typed Any (negative powers)
        return min(self.limits.backoff_initial_s * growth, self.limits.backoff_max_s)

    def stop_reason(
        self, verdict: ExitVerdict, name: str, code: int, log_path: pathlib.Path, setting: str
    ) -> str:
        """Why an exit that is never restarted stops the run, with the end of its log.
        `setting`: where the role's environment is chosen (`key=value`), for a missing component."""
        if verdict is ExitVerdict.CONFIG_REJECTED:
            what = (
                f"{name} rejected its configuration (exit code {code}); not restarted, "
                "since the same config would be rejected again"
            )
        elif verdict is ExitVerdict.MISSING_COMPONENT:
            what = (
                f"{name}: its component is not installed in its role's environment "
                f"(exit code {code}; {setting})"
            )
        else:
            raise ValueError(f"{verdict} does not stop the run")
        return f"{what}. Last lines of {log_path}:\n{log_tail(log_path)}"

    def budget_reason(self, what: str, log_path: pathlib.Path) -> str:
        """Why too many failures stop the run: `what` says which process failed how often."""
        return (
            f"{what}, over the limit supervisor.max_restarts={self.limits.max_restarts}. "
            f"Last lines of {log_path}:\n{log_tail(log_path)}"
        )
