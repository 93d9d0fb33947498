"""Gang supervision (a multi-host trainer): members live and die together. Real child
processes (small Python programs written here); every pid they report is checked dead."""

from __future__ import annotations

import pathlib

import pytest
from child_processes import alive, events, py

from rlax_controller.supervisor import ProcessSpec, Supervisor
from rlax_controller.testing import check_no_unplanned_restarts
from rlax_core.config import EXIT_CONFIG_ERROR, ChaosSection, SupervisorSection

POLICY = SupervisorSection(max_restarts=3, backoff_initial_s=0.05, backoff_max_s=0.2, shutdown_grace_s=1.0)


def member(starts: pathlib.Path, name: str, *, fail_on: tuple[int, ...] = (), code: int = 3,
           ignore_sigterm: bool = False, peers: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """Appends `name pid` to `starts` at each start; exits `code` on the starts listed in
    `fail_on` (0-based) once each of `peers` is up in the same life (its line written, after
    its SIGTERM handler), else sleeps (optionally deaf to SIGTERM, so only SIGKILL ends it)."""
    return py(
        f"""
        import os, pathlib, signal, sys, time
        if {ignore_sigterm}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        path = pathlib.Path({str(starts)!r})
        mine = [l for l in (path.read_text().splitlines() if path.exists() else []) if l.startswith({name!r} + " ")]
        with open(path, "a") as handle:
            handle.write(f"{name} {{os.getpid()}}\\n")
        if len(mine) in {fail_on!r}:
            deadline = time.monotonic() + 120  # bounds a hang; the test's checks then fail
            def lives(peer):
                return sum(1 for l in path.read_text().splitlines() if l.startswith(peer + " "))
            while any(lives(p) <= len(mine) for p in {peers!r}) and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.exit({code})
        time.sleep(120)
        """
    )


def finisher(starts: pathlib.Path, lines: int, log_dir: pathlib.Path, restarted: int) -> list[str]:
    """Completes the run once `restarted` restarts were logged and `starts` holds `lines`
    lines (or after 120 s, so that a broken supervisor fails the test's checks, not hangs)."""
    return py(
        f"""
        import json, pathlib, time
        path, log = pathlib.Path({str(starts)!r}), pathlib.Path({str(log_dir)!r}) / "events.jsonl"
        deadline = time.monotonic() + 120
        def restarts():
            lines = log.read_text().splitlines() if log.exists() else []
            return sum(1 for e in map(json.loads, lines) if e["event"] == "start" and e["restarts"] > 0)
        def started():
            return len(path.read_text().splitlines()) if path.exists() else 0
        while time.monotonic() < deadline and (restarts() < {restarted} or started() < {lines}):
            time.sleep(0.02)
        """
    )


def started(starts: pathlib.Path) -> list[tuple[str, int]]:
    return [(n, int(p)) for n, p in (line.split() for line in starts.read_text().splitlines())]


def test_a_member_exit_stops_and_restarts_the_whole_gang(tmp_path: pathlib.Path) -> None:
    """trainer1 crashes on its first start: trainer0 (SIGTERM) and trainer2 (deaf to SIGTERM:
    SIGKILL after the grace period) are stopped, and all three restart with new pids; the
    worker outside the gang is left alone."""
    starts = tmp_path / "starts"
    specs = [
        ProcessSpec("trainer0", "trainer", member(starts, "trainer0"), gang="trainer"),
        ProcessSpec(
            "trainer1",
            "trainer",
            member(starts, "trainer1", fail_on=(0,), peers=("trainer0", "trainer2")),
            gang="trainer",
        ),
        ProcessSpec("trainer2", "trainer", member(starts, "trainer2", ignore_sigterm=True), gang="trainer"),
        ProcessSpec("worker0", "worker", member(starts, "worker0")),
        ProcessSpec("main", "controller", finisher(starts, 7, tmp_path / "logs", 3), completes_run=True),
    ]
    report = Supervisor(specs, tmp_path / "logs", POLICY).run(install_signal_handlers=False)
    assert report.success, report.render()
    runs = started(starts)
    for name in ("trainer0", "trainer1", "trainer2"):
        pids = [pid for n, pid in runs if n == name]
        assert len(pids) == 2 and pids[0] != pids[1], runs
        assert report.restarts[name] == 1
    assert [n for n, _ in runs].count("worker0") == 1 and report.restarts["worker0"] == 0
    assert all(not alive(pid) for _, pid in runs)

    log = events(tmp_path / "logs")
    exits = {e["name"]: e for e in log if e["event"] == "exit" and e.get("gang") == "trainer"}
    assert exits["trainer1"]["code"] == 3 and not exits["trainer1"]["gang_stop"]
    assert exits["trainer0"]["gang_stop"] and exits["trainer0"]["code"] == -15  # SIGTERM
    assert exits["trainer2"]["gang_stop"] and exits["trainer2"]["code"] == -9  # deaf: SIGKILL
    [restart] = [e for e in log if e["event"] == "gang_restart"]
    assert restart["gang"] == "trainer" and restart["cause"] == "trainer1" and restart["code"] == 3
    assert restart["members"] == ["trainer0", "trainer1", "trainer2"] and not restart["chaos"]
    # Every member was down before any of them started again.
    restarted_at = min(i for i, e in enumerate(log) if e["event"] == "start" and e["restarts"] == 1)
    assert all(log.index(exits[n]) < restarted_at for n in exits)
    assert log.index(restart) < restarted_at
    # One unplanned exit: the crash; the members stopped with it are its consequence.
    assert [(u.name, u.code) for u in report.unplanned_restarts] == [("trainer1", 3)]
    with pytest.raises(AssertionError, match=r"trainer1 \(trainer\) exited with code 3"):
        check_no_unplanned_restarts(report)


def test_the_restart_limit_counts_gang_restarts_not_member_exits(tmp_path: pathlib.Path) -> None:
    """trainer1 always crashes; each crash makes three exits. With max_restarts=2 the gang
    restarts twice and the third crash stops the run."""
    starts = tmp_path / "starts"
    specs = [
        ProcessSpec("trainer0", "trainer", member(starts, "trainer0"), gang="trainer"),
        ProcessSpec(
            "trainer1",
            "trainer",
            member(starts, "trainer1", fail_on=(0, 1, 2, 3, 4), peers=("trainer0", "trainer2")),
            gang="trainer",
        ),
        ProcessSpec("trainer2", "trainer", member(starts, "trainer2"), gang="trainer"),
        ProcessSpec("main", "controller", py("import time; time.sleep(60)"), completes_run=True),
    ]
    policy = SupervisorSection(
        max_restarts=2, backoff_initial_s=0.05, backoff_max_s=0.2, shutdown_grace_s=1.0
    )
    report = Supervisor(specs, tmp_path / "logs", policy).run(install_signal_handlers=False)
    assert not report.success
    assert "trainer1 (gang trainer) exited with code 3" in report.reason
    assert "max_restarts=2" in report.reason
    assert report.restarts == {"trainer0": 2, "trainer1": 2, "trainer2": 2, "main": 0}
    assert report.exit_codes["trainer1"] == [3, 3, 3]
    restarts = [e for e in events(tmp_path / "logs") if e["event"] == "gang_restart"]
    assert [e["failures"] for e in restarts] == [1, 2]
    assert all(not alive(pid) for _, pid in started(starts))


def test_a_member_that_rejects_its_config_stops_the_run(tmp_path: pathlib.Path) -> None:
    starts = tmp_path / "starts"
    specs = [
        ProcessSpec("trainer0", "trainer", member(starts, "trainer0"), gang="trainer"),
        ProcessSpec(
            "trainer1",
            "trainer",
            member(starts, "trainer1", fail_on=(0,), code=EXIT_CONFIG_ERROR, peers=("trainer0",)),
            gang="trainer",
        ),
        ProcessSpec("main", "controller", py("import time; time.sleep(60)"), completes_run=True),
    ]
    report = Supervisor(specs, tmp_path / "logs", POLICY).run(install_signal_handlers=False)
    assert not report.success and report.config_error
    assert "trainer1 rejected its configuration" in report.reason
    assert report.restarts == {"trainer0": 0, "trainer1": 0, "main": 0}
    log = events(tmp_path / "logs")
    assert not any(e["event"] in ("restart_scheduled", "gang_restart") for e in log)
    assert all(not alive(pid) for _, pid in started(starts))


def test_a_chaos_kill_of_one_member_restarts_the_gang_without_counting_a_failure(
    tmp_path: pathlib.Path,
) -> None:
    """max_restarts=0: a crash would stop the run, a chaos kill must not."""
    starts = tmp_path / "starts"
    specs = [
        ProcessSpec("trainer0", "trainer", member(starts, "trainer0"), gang="trainer"),
        ProcessSpec("trainer1", "trainer", member(starts, "trainer1"), gang="trainer"),
        ProcessSpec("main", "controller", finisher(starts, 4, tmp_path / "logs", 2), completes_run=True),
    ]
    policy = SupervisorSection(
        max_restarts=0, backoff_initial_s=0.05, backoff_max_s=0.2, shutdown_grace_s=1.0
    )
    chaos = ChaosSection(interval=0.5, seed=1, targets=["trainer"], max_kills=1)
    report = Supervisor(specs, tmp_path / "logs", policy, chaos).run(install_signal_handlers=False)
    assert report.success, report.render()
    [(victim, role)] = report.chaos_kills
    assert role == "trainer"
    [restart] = [e for e in events(tmp_path / "logs") if e["event"] == "gang_restart"]
    assert restart["cause"] == victim and restart["chaos"] and restart["failures"] == 0
    assert report.restarts == {"trainer0": 1, "trainer1": 1, "main": 0}
    check_no_unplanned_restarts(report)  # the kill and the member stopped with it are planned
    assert all(not alive(pid) for _, pid in started(starts))
