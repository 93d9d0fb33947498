"""The local backend's process supervisor behind `rlax launch`.

Starts every component as a subprocess in its own process group (so a component's
children die with it) and applies the launcher's restart policy (`restart_policy`): a
process that exits or crashes restarts with exponential back-off; the run stops with a
report when one process needs too many restarts, or exits with `EXIT_CONFIG_ERROR` (its
config was rejected) or `EXIT_MISSING_COMPONENT` (its role's package is not installed),
which a restart would only repeat. Everything shuts down on SIGINT/SIGTERM (SIGTERM to
each group, SIGKILL after a grace period). Processes of one gang (a multi-host trainer
joined by `jax.distributed`, which cannot continue without any of its members) live and
die together: when a member exits for any reason, the others are stopped (SIGTERM,
SIGKILL after the grace period) and all restart together once every member is down
(`gang_restart` event); `max_restarts` counts the gang's restarts after failures, not the
N exits one failure causes. Chaos mode (`chaos.ChaosSchedule`) SIGKILLs a random
component at seeded random moments. Every start, exit, restart and kill is appended to
`events.jsonl`.

Planned and unplanned exits. A chaos kill is planned, and so is the completing process's
clean exit; every other exit (a crash, a component that exited on its own, one killed from
outside) is unplanned: its `exit` event says `unplanned: true` and carries the end of what
that life wrote to its log (its traceback), and `SupervisorReport.unplanned_restarts` lists
them. Members of a gang stopped because another member exited are that exit's consequence,
not unplanned exits of their own. A run that is restarted after a crash still finishes; what
a chaos or end-to-end test makes of the crash is `rlax_controller.testing`'s check.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rlax_controller.chaos import ChaosSchedule
from rlax_controller.process_plan import ProcessSpec
from rlax_controller.restart_policy import UNPLANNED_TAIL_LINES, ExitVerdict, RestartPolicy, log_tail
from rlax_controller.run_report import SupervisorReport, UnplannedRestart
from rlax_core.config import ChaosSection, SupervisorSection
from rlax_core.fsutil import append_line_durable

# The report and process types are part of this module's interface: callers build specs
# and read reports without knowing where they are defined.
__all__ = ["ManagedProcess", "ProcessSpec", "Supervisor", "SupervisorReport", "UnplannedRestart"]

PR_SET_PDEATHSIG = 1


def _parent_death_signal() -> Callable[[], None] | None:
    """What a component runs between fork and exec so that it gets SIGTERM when the launcher
    dies (Linux's PR_SET_PDEATHSIG), and exits at once if it already has. A launcher killed
    with SIGKILL cannot stop its components; before this they ran on as orphans (a SmolLM2
    trainer and worker: ~3.5 GB, pushing and generating for nobody) and held the run's
    addresses. SIGTERM, not SIGKILL: each component stops as it does when the launcher stops
    it. None where prctl does not exist (macOS: orphans remain possible there)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before the prctl took effect
            os._exit(1)

    return in_child


@dataclasses.dataclass
class ManagedProcess:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    consecutive_failures: int = 0
    restart_at: float | None = None
    killed_by_chaos: bool = False
    exit_codes: list[int] = dataclasses.field(default_factory=list)
    log_offset: int = 0  # where this life's output starts in its log file

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclasses.dataclass
class _Gang:
    """Supervision state of one gang. While `stopping`, the members still running are
    being stopped because `cause` exited; `down` holds the members that have exited."""

    name: str
    members: list[ManagedProcess]
    stopping: bool = False
    cause: str = ""
    cause_code: int = 0
    by_chaos: bool = False
    delay_s: float = 0.0
    kill_at: float = 0.0
    down: set[str] = dataclasses.field(default_factory=set)
    failures: int = 0  # restarts after a non-chaos exit: what supervisor.max_restarts limits
    consecutive_failures: int = 0
    started_at: float = 0.0


class Supervisor:
    """Runs and supervises a set of `ProcessSpec`s until one with `completes_run` exits 0."""

    def __init__(
        self,
        specs: list[ProcessSpec],
        log_dir: str | pathlib.Path,
        policy: SupervisorSection | None = None,
        chaos: ChaosSection | None = None,
        *,
        poll_s: float = 0.05,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        self.policy = policy or SupervisorSection()
        self.restart = RestartPolicy(self.policy)
        self.chaos = chaos or ChaosSection()
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.log_dir / "events.jsonl"
        self.procs = [ManagedProcess(spec) for spec in specs]
        self._gangs: dict[str, _Gang] = {}
        for proc in self.procs:
            if proc.spec.gang:
                self._gangs.setdefault(proc.spec.gang, _Gang(proc.spec.gang, [])).members.append(proc)
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._stop_reason = ""
        self._chaos = ChaosSchedule(self.chaos)
        self.chaos_kills = self._chaos.kills  # (process, role) of every chaos kill, in order
        self.unplanned: list[UnplannedRestart] = []

    # -- events -------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": kind, **fields}
        append_line_durable(self.events_path, json.dumps(record))

    # -- process control ----------------------------------------------------------------
    def _start(self, proc: ManagedProcess) -> None:
        log = open(self.log_dir / f"{proc.spec.name}.log", "ab")
        proc.log_offset = log.seek(0, os.SEEK_END)
        # glibc gives every thread that allocates its own malloc arena and keeps what they
        # free: orbax's writer threads grew the trainer's RSS by ~0.7 GB per checkpoint
        # (SmolLM2: 3.8 -> 6.6 GB in four steps; stable at 4.2 GB with two arenas).
        # A value the user set is kept.
        env = {"MALLOC_ARENA_MAX": "2", **os.environ}
        env.update(proc.spec.env or {})
        try:
            proc.popen = subprocess.Popen(
                proc.spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=proc.spec.cwd,
                start_new_session=True,
                # The signal is tied to the forking *thread*: `run` starts and restarts every
                # component from its own thread, which outlives them all.
                preexec_fn=_parent_death_signal(),
            )
        finally:
            log.close()
        proc.started_at = time.monotonic()
        proc.restart_at = None
        proc.killed_by_chaos = False
        self._event(
            "start", name=proc.spec.name, role=proc.spec.role, pid=proc.popen.pid, restarts=proc.restarts
        )

    def _signal_group(self, proc: ManagedProcess, sig: int) -> None:
        if proc.popen is None:
            return
        try:
            os.killpg(proc.popen.pid, sig)
        except ProcessLookupError:
            pass

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ask the run loop to shut everything down (thread-safe; used by signal handlers)."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def _handle_signal(self, signum: int, _frame: Any) -> None:
        self.request_stop(f"received {signal.Signals(signum).name}")

    def _shutdown(self) -> None:
        for proc in reversed(self.procs):
            if proc.running:
                self._signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.policy.shutdown_grace_s
        while time.monotonic() < deadline and any(p.running for p in self.procs):
            time.sleep(self.poll_s)
        for proc in self.procs:
            # SIGKILL the group even if the leader exited: its children may linger.
            self._signal_group(proc, signal.SIGKILL)
            if proc.popen is not None:
                proc.popen.wait()
        self._event("shutdown", reason=self._stop_reason)

    # -- chaos --------------------------------------------------------------------------
    def _schedule_kill(self, now: float) -> None:
        self._chaos.schedule(now)

    @property
    def _next_kill(self) -> float:
        return self._chaos.next_kill

    def _chaos_tick(self, now: float) -> None:
        def running(role: str) -> list[str]:
            return [
                p.spec.name for p in self.procs if p.spec.role == role and p.running and not self._stopping(p)
            ]

        picked = self._chaos.pick(now, [p.spec.role for p in self.procs], running)
        if picked is None:
            return
        victim = next(p for p in self.procs if p.spec.name == picked[0])
        assert victim.popen is not None
        self._event("chaos_kill", name=picked[0], role=picked[1], pid=victim.popen.pid)
        victim.killed_by_chaos = True
        self._signal_group(victim, signal.SIGKILL)

    # -- main loop ----------------------------------------------------------------------
    def _on_exit(self, proc: ManagedProcess, code: int, now: float) -> SupervisorReport | None:
        proc.exit_codes.append(code)
        by_chaos = proc.killed_by_chaos
        gang = self._gangs.get(proc.spec.gang)
        log_path = self.log_dir / f"{proc.spec.name}.log"
        fields: dict[str, Any] = {} if gang is None else {"gang": gang.name, "gang_stop": gang.stopping}
        verdict = self.restart.verdict(code, completes_run=proc.spec.completes_run, by_chaos=by_chaos)
        completes = verdict is ExitVerdict.COMPLETED
        if not (by_chaos or completes or (gang is not None and gang.stopping)):
            unplanned = UnplannedRestart(
                proc.spec.name,
                proc.spec.role,
                code,
                log_tail(log_path, UNPLANNED_TAIL_LINES, offset=proc.log_offset),
            )
            self.unplanned.append(unplanned)
            fields.update(unplanned=True, log_tail=unplanned.log_tail)
        self._event("exit", name=proc.spec.name, role=proc.spec.role, code=code, chaos=by_chaos, **fields)
        if completes:
            self._stop_reason = f"{proc.spec.name} completed the run"
            return self._finish(True, self._stop_reason)
        if verdict in (ExitVerdict.CONFIG_REJECTED, ExitVerdict.MISSING_COMPONENT):
            setting = (
                f"supervisor.interpreters.{proc.spec.role}={proc.spec.argv[0] if proc.spec.argv else ''}"
            )
            self._stop_reason = self.restart.stop_reason(verdict, proc.spec.name, code, log_path, setting)
            return self._finish(False, self._stop_reason, config_error=True)
        if gang is not None:
            return self._on_gang_exit(gang, proc, code, now)
        if by_chaos:
            proc.consecutive_failures = 0
        else:
            proc.consecutive_failures = self.restart.failure_streak(
                proc.consecutive_failures, now - proc.started_at
            )
            failures = proc.restarts - self._chaos.kills_of(proc.spec.name) + 1  # this exit's included
            if self.restart.over_budget(failures):
                self._stop_reason = self.restart.budget_reason(
                    f"{proc.spec.name} exited with code {code} and was restarted {proc.restarts} time(s)",
                    log_path,
                )
                return self._finish(False, self._stop_reason)
        delay = self.restart.backoff_s(proc.consecutive_failures, by_chaos=by_chaos)
        proc.restart_at = now + delay
        self._event("restart_scheduled", name=proc.spec.name, delay_s=delay)
        return None

    def _on_gang_exit(
        self, gang: _Gang, proc: ManagedProcess, code: int, now: float
    ) -> SupervisorReport | None:
        """A gang member exited: the first exit stops the others (all restart together in
        `_gang_tick` once every member is down); later ones are members going down with it."""
        proc.restart_at = math.inf  # waits for its gang (never polled again until restarted)
        gang.down.add(proc.spec.name)
        if gang.stopping:
            return None
        if proc.killed_by_chaos:
            gang.consecutive_failures = 0
        else:
            gang.consecutive_failures = self.restart.failure_streak(
                gang.consecutive_failures, now - gang.started_at
            )
            if self.restart.over_budget(gang.failures + 1):  # this exit's failure included
                self._stop_reason = self.restart.budget_reason(
                    f"{proc.spec.name} (gang {gang.name}) exited with code {code}; the gang was "
                    f"restarted {gang.failures} time(s) after failures",
                    self.log_dir / f"{proc.spec.name}.log",
                )
                return self._finish(False, self._stop_reason)
        delay = self.restart.backoff_s(gang.consecutive_failures, by_chaos=proc.killed_by_chaos)
        gang.stopping, gang.cause, gang.cause_code = True, proc.spec.name, code
        gang.by_chaos, gang.delay_s = proc.killed_by_chaos, delay
        gang.kill_at = now + self.policy.shutdown_grace_s
        for member in gang.members:
            if member is not proc and member.running:
                self._signal_group(member, signal.SIGTERM)
        self._event("gang_stop", gang=gang.name, cause=proc.spec.name, code=code, chaos=gang.by_chaos)
        return None

    def _gang_tick(self, now: float) -> None:
        """Stopping gangs: SIGKILL members past the grace period; once every member is
        down, schedule all of them to restart together."""
        for gang in self._gangs.values():
            if not gang.stopping:
                continue
            if now >= gang.kill_at:
                for member in gang.members:
                    if member.spec.name not in gang.down:
                        self._signal_group(member, signal.SIGKILL)
            if len(gang.down) < len(gang.members):
                continue
            for member in gang.members:
                self._signal_group(member, signal.SIGKILL)  # children of a member may linger
                member.restart_at = now + gang.delay_s
                self._event("restart_scheduled", name=member.spec.name, delay_s=gang.delay_s)
            if not gang.by_chaos:
                gang.failures += 1
            self._event(
                "gang_restart",
                gang=gang.name,
                cause=gang.cause,
                code=gang.cause_code,
                chaos=gang.by_chaos,
                delay_s=gang.delay_s,
                members=[m.spec.name for m in gang.members],
                failures=gang.failures,
            )
            gang.stopping = False
            gang.down.clear()
            gang.started_at = now + gang.delay_s

    def _stopping(self, proc: ManagedProcess) -> bool:
        gang = self._gangs.get(proc.spec.gang)
        return gang is not None and gang.stopping

    def _finish(self, success: bool, reason: str, *, config_error: bool = False) -> SupervisorReport:
        self._shutdown()
        return SupervisorReport(
            success=success,
            reason=reason,
            restarts={p.spec.name: p.restarts for p in self.procs},
            chaos_kills=list(self.chaos_kills),
            exit_codes={p.spec.name: list(p.exit_codes) for p in self.procs},
            log_dir=self.log_dir,
            config_error=config_error,
            unplanned_restarts=list(self.unplanned),
        )

    def run(
        self, *, install_signal_handlers: bool = True, on_tick: Callable[[], None] | None = None
    ) -> SupervisorReport:
        """Start everything and supervise until the run completes, fails or is stopped.
        `on_tick` runs every ~0.25 s in the supervising thread (progress display)."""
        previous: dict[signal.Signals, Any] = {}
        if install_signal_handlers:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._handle_signal)
        try:
            for proc in self.procs:
                self._start(proc)
            for gang in self._gangs.values():
                gang.started_at = time.monotonic()
            self._schedule_kill(time.monotonic())
            last_tick = 0.0
            while True:
                if self._stop.is_set():
                    return self._finish(False, self._stop_reason)
                now = time.monotonic()
                for proc in self.procs:
                    if proc.popen is not None and proc.restart_at is None:
                        code = proc.popen.poll()
                        if code is not None:
                            report = self._on_exit(proc, code, now)
                            if report is not None:
                                return report
                    if proc.restart_at is not None and now >= proc.restart_at:
                        proc.restarts += 1
                        self._start(proc)
                self._gang_tick(now)
                self._chaos_tick(now)
                if on_tick is not None and now - last_tick >= 0.25:
                    last_tick = now
                    on_tick()
                self._stop.wait(self.poll_s)
        except BaseException:
            self._stop_reason = self._stop_reason or "supervisor error"
            self._shutdown()
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
