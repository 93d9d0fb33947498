"""The supervisor with real child processes (small Python programs written here)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from child_processes import alive, completes_when, events, py, restarted_after_chaos, survivors

from rlax_controller.supervisor import ProcessSpec, Supervisor
from rlax_controller.testing import check_no_unplanned_restarts, unplanned_restarts
from rlax_core.config import EXIT_CONFIG_ERROR, ChaosSection, SupervisorSection
from rlax_core.testing import wait_until

FAST = SupervisorSection(max_restarts=3, backoff_initial_s=0.05, backoff_max_s=0.2, shutdown_grace_s=2.0)


def test_crashing_process_restarts_then_run_completes(tmp_path: pathlib.Path) -> None:
    counter = tmp_path / "count"
    # Crashes on its first two starts, then completes the run.
    child = py(
        f"""
        import pathlib, sys
        p = pathlib.Path({str(counter)!r})
        n = int(p.read_text()) if p.exists() else 0
        p.write_text(str(n + 1))
        sys.exit(0 if n >= 2 else 3)
        """
    )
    sleeper = py("import time; time.sleep(60)")
    sup = Supervisor(
        [
            ProcessSpec("main", "controller", child, completes_run=True),
            ProcessSpec("side", "worker", sleeper),
        ],
        tmp_path / "logs",
        FAST,
    )
    report = sup.run(install_signal_handlers=False)
    assert report.success, report.render()
    assert counter.read_text() == "3"
    assert report.restarts["main"] == 2 and report.exit_codes["main"] == [3, 3, 0]
    side_pid = next(
        e["pid"] for e in events(tmp_path / "logs") if e["event"] == "start" and e["name"] == "side"
    )
    assert not alive(side_pid)
    delays = [e["delay_s"] for e in events(tmp_path / "logs") if e["event"] == "restart_scheduled"]
    assert delays == [0.05, 0.1]  # exponential back-off


def test_too_many_restarts_stops_the_run_with_a_report(tmp_path: pathlib.Path) -> None:
    crasher = py("import sys; print('boom: bad thing happened', flush=True); sys.exit(7)")
    sup = Supervisor(
        [
            ProcessSpec("trainer", "trainer", crasher),
            ProcessSpec("main", "controller", py("import time; time.sleep(60)"), completes_run=True),
        ],
        tmp_path,
        FAST,
    )
    report = sup.run(install_signal_handlers=False)
    assert not report.success
    assert "trainer exited with code 7" in report.reason
    assert "max_restarts=3" in report.reason
    assert "boom: bad thing happened" in report.reason  # the tail of its log
    assert report.restarts["trainer"] == 3
    assert "trainer: 3 restart(s)" in report.render()


def test_a_component_that_rejects_its_config_is_not_restarted_and_stops_the_run(
    tmp_path: pathlib.Path,
) -> None:
    starts = tmp_path / "starts"
    starts.mkdir()
    rejecting = py(
        f"""
        import os, pathlib, sys
        pathlib.Path({str(starts)!r}, str(os.getpid())).touch()
        print("rlax trainer: invalid config: micro_batch=5 must divide the 32 rollouts", file=sys.stderr)
        sys.exit({EXIT_CONFIG_ERROR})
        """
    )
    sup = Supervisor(
        [
            ProcessSpec("trainer", "trainer", rejecting),
            ProcessSpec("main", "controller", py("import time; time.sleep(60)"), completes_run=True),
        ],
        tmp_path / "logs",
        SupervisorSection(max_restarts=20, backoff_initial_s=0.05, backoff_max_s=0.05, shutdown_grace_s=2.0),
    )
    report = sup.run(install_signal_handlers=False)
    assert not report.success and report.config_error
    assert len(list(starts.iterdir())) == 1 and report.restarts["trainer"] == 0
    assert report.exit_codes["trainer"] == [EXIT_CONFIG_ERROR]
    assert "trainer rejected its configuration" in report.reason
    assert "micro_batch=5 must divide the 32 rollouts" in report.reason  # the component's own message
    assert not any(e["event"] == "restart_scheduled" for e in events(tmp_path / "logs"))


def test_sigint_shuts_down_every_process_group_no_orphans(tmp_path: pathlib.Path) -> None:
    # A launcher process running the supervisor; its children spawn grandchildren.
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "launch.py"
    child = textwrap.dedent(
        f"""
        import os, subprocess, sys, time, pathlib
        g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
        pathlib.Path({str(pids)!r}, str(os.getpid())).write_text(str(g.pid))
        time.sleep(120)
        """
    )
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from rlax_core.config import SupervisorSection
            from rlax_controller.supervisor import ProcessSpec, Supervisor
            child = [sys.executable, '-c', {child!r}]
            specs = [ProcessSpec(f'p{{i}}', 'worker', child) for i in range(3)]
            report = Supervisor(specs, {str(tmp_path / "logs")!r}, SupervisorSection(shutdown_grace_s=2.0)).run()
            print(report.reason, flush=True)
            sys.exit(0 if 'SIGINT' in report.reason else 1)
            """
        )
    )
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        # A child writes its file once its grandchild is started: all three are up.
        wait_until(lambda: len(list(pids.iterdir())) == 3, what="three children up")
        wait_until(
            lambda: all(p.read_text() for p in pids.iterdir()), what="their grandchildren's pids written"
        )
        recorded = {int(p.name): int(p.read_text()) for p in pids.iterdir()}
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out
    assert "received SIGINT" in out
    # The launcher waited for its children; an orphaned grandchild is reaped by init soon
    # after its SIGKILL. A survivor (its process group was not killed) would run for 120 s.
    left = survivors([*recorded, *recorded.values()])
    assert not left, f"survived the launcher's shutdown: the process group was not killed: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launcher_killed_with_sigkill_leaves_no_component_running(tmp_path: pathlib.Path) -> None:
    # SIGKILL gives the supervisor no chance to stop anything: the components must notice on
    # their own (they used to run on as orphans, a SmolLM2 run's trainer and worker included).
    pids = tmp_path / "pids"
    pids.mkdir()
    child = (
        f"import os, pathlib, time; pathlib.Path({str(pids)!r}, str(os.getpid())).touch(); time.sleep(120)"
    )
    script = tmp_path / "launch.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from rlax_core.config import SupervisorSection
            from rlax_controller.supervisor import ProcessSpec, Supervisor
            specs = [ProcessSpec(f'p{{i}}', 'worker', [sys.executable, '-c', {child!r}]) for i in range(3)]
            Supervisor(specs, {str(tmp_path / "logs")!r}, SupervisorSection(shutdown_grace_s=2.0)).run()
            """
        )
    )
    launcher = subprocess.Popen([sys.executable, str(script)])
    try:
        wait_until(lambda: len(list(pids.iterdir())) == 3, what="three components up")
        children = [int(p.name) for p in pids.iterdir()]
        assert all(alive(pid) for pid in children)
    finally:
        launcher.kill()
        launcher.wait()
    left = survivors(children)
    assert not left, f"components outlived their SIGKILLed launcher: {left}"


def test_chaos_kills_every_role_and_processes_come_back(tmp_path: pathlib.Path) -> None:
    starts = tmp_path / "starts"
    starts.mkdir()
    child = py(
        f"""
        import os, pathlib, time
        pathlib.Path({str(starts)!r}, str(os.getpid())).touch()
        time.sleep(120)
        """
    )
    roles = ["worker", "trainer", "paramserver"]
    # The run completes once chaos killed a process of every role and that process is back.
    every_role_back = " and ".join(restarted_after_chaos(role, starts) for role in roles)
    done = completes_when(tmp_path / "logs", every_role_back)
    specs = [ProcessSpec(f"{r}0", r, child) for r in roles] + [ProcessSpec("w1", "worker", child)]
    specs.append(ProcessSpec("main", "controller", done, completes_run=True))
    chaos = ChaosSection(interval=0.2, seed=3, targets=roles)
    report = Supervisor(specs, tmp_path / "logs", FAST, chaos).run(install_signal_handlers=False)
    assert report.success, report.render()
    killed_roles = {role for _, role in report.chaos_kills}
    assert killed_roles == set(roles)
    log = events(tmp_path / "logs")
    for name, _ in report.chaos_kills:
        assert any(e["event"] == "exit" and e["name"] == name and e["chaos"] for e in log)
    check_no_unplanned_restarts(report)  # every exit was chaos's
    check_no_unplanned_restarts(tmp_path)
    # A victim of every role was started again and is up (what `done` waited for)...
    for role in roles:
        victims = {n for n, r in report.chaos_kills if r == role}
        assert any(e["event"] == "start" and e["name"] in victims and e["restarts"] > 0 for e in log), role
    # ... and every chaos victim was scheduled for a restart (the run may end before the last
    # one's back-off does).
    for i, e in enumerate(log):
        if e["event"] == "exit" and e["chaos"]:
            after = [f["event"] for f in log[i + 1 :] if f.get("name") == e["name"]]
            assert after[:1] == ["restart_scheduled"], (e, after)
    for p in starts.iterdir():
        assert not alive(int(p.name))


def test_chaos_schedule_is_seeded(tmp_path: pathlib.Path) -> None:
    def schedule(seed: int) -> list[float]:
        sup = Supervisor(
            [ProcessSpec("a", "worker", ["true"])],
            tmp_path / f"s{seed}",
            chaos=ChaosSection(interval=1.0, seed=seed),
        )
        out = []
        for _ in range(5):
            sup._schedule_kill(0.0)
            out.append(sup._next_kill)
        return out

    assert schedule(1) == schedule(1)
    assert schedule(1) != schedule(2)


@pytest.mark.parametrize(("chosen", "expected"), [(None, "2"), ("8", "8")])
def test_components_start_with_two_malloc_arenas_unless_the_user_chose(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, chosen: str | None, expected: str
) -> None:
    if chosen is None:
        monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    else:
        monkeypatch.setenv("MALLOC_ARENA_MAX", chosen)
    out = tmp_path / "arenas"
    child = py(
        """
        import os, pathlib, sys
        pathlib.Path(sys.argv[1]).write_text(os.environ.get("MALLOC_ARENA_MAX", "unset"))
        """
    )
    sup = Supervisor(
        [ProcessSpec("main", "trainer", [*child, str(out)], completes_run=True)], tmp_path / "logs", FAST
    )
    assert sup.run(install_signal_handlers=False).success
    assert out.read_text() == expected


def test_an_unplanned_crash_is_restarted_but_the_check_fails_with_its_traceback(
    tmp_path: pathlib.Path,
) -> None:
    """Issue 29: the controller died of an AssertionError, was restarted, and the chaos test
    passed. The run still finishes here; the check every such test makes does not."""
    marker, back = tmp_path / "crashed", tmp_path / "back"
    crashing = py(
        f"""
        import pathlib, time
        print("worker starting", flush=True)
        marker = pathlib.Path({str(marker)!r})
        if not marker.exists():
            marker.touch()
            def dispatch(groups):
                assert groups, "a group released under the loop"
            dispatch([])
        pathlib.Path({str(back)!r}).touch()
        time.sleep(120)
        """
    )
    trainer_killed_worker_back = (
        f"any(e['event'] == 'chaos_kill' for e in events) and pathlib.Path({str(back)!r}).exists()"
    )
    specs = [
        ProcessSpec("worker0", "worker", crashing),
        ProcessSpec("trainer", "trainer", py("import time; time.sleep(120)")),
        # Completes once chaos killed the trainer and the crashed worker's second life is up.
        ProcessSpec(
            "main",
            "controller",
            completes_when(tmp_path / "logs", trainer_killed_worker_back),
            completes_run=True,
        ),
    ]
    chaos = ChaosSection(interval=0.3, seed=0, targets=["trainer"], max_kills=1)
    report = Supervisor(specs, tmp_path / "logs", FAST, chaos).run(install_signal_handlers=False)
    assert report.success and report.restarts["worker0"] == 1  # the run itself saw nothing wrong
    assert [n for n, _ in report.chaos_kills] == ["trainer"]
    [crash] = report.unplanned_restarts  # the chaos kill is planned, the crash is not
    assert (crash.name, crash.role, crash.code) == ("worker0", "worker", 1)
    assert "unplanned exits: 1 (worker0 (code 1))" in report.render()
    for source in (report, tmp_path, tmp_path / "logs"):  # in process, or from events.jsonl
        assert unplanned_restarts(source) == [crash]
        with pytest.raises(AssertionError) as info:
            check_no_unplanned_restarts(source)
        message = str(info.value)
        assert "worker0 (worker) exited with code 1" in message
        assert "Traceback (most recent call last)" in message
        assert "AssertionError: a group released under the loop" in message
        assert message.count("worker starting") == 1  # that life's log, not the next one's


def test_kills_the_test_made_itself_are_excused_once_each(tmp_path: pathlib.Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    child = py(
        f"""
        import os, pathlib, time
        pathlib.Path({str(pids)!r}, str(os.getpid())).touch()
        time.sleep(120)
        """
    )
    specs = [
        ProcessSpec("worker0", "worker", child),
        # Completes once the test's two kills are done and worker0's third life is up.
        ProcessSpec(
            "main",
            "controller",
            completes_when(tmp_path / "logs", f"len(list(pathlib.Path({str(pids)!r}).iterdir())) >= 3"),
            completes_run=True,
        ),
    ]

    def kill_twice() -> None:  # the test's own kills, from outside the supervisor
        for count in (1, 2):
            wait_until(lambda n=count: len(list(pids.iterdir())) >= n, what=f"worker0's life {count} up")
            newest = max(pids.iterdir(), key=lambda p: p.stat().st_mtime_ns)
            os.killpg(int(newest.name), signal.SIGKILL)

    killer = threading.Thread(target=kill_twice, daemon=True)
    killer.start()
    report = Supervisor(specs, tmp_path / "logs", FAST).run(install_signal_handlers=False)
    killer.join(timeout=30)
    assert not killer.is_alive()
    assert report.success and [u.code for u in report.unplanned_restarts] == [-signal.SIGKILL] * 2
    check_no_unplanned_restarts(report, caused=["worker0", "worker0"])
    with pytest.raises(AssertionError, match=r"worker0 \(worker\) killed by signal 9"):
        check_no_unplanned_restarts(report, caused=["worker0"])  # one kill more than the test made
