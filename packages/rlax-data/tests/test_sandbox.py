"""The sandbox stops or confines hostile programs, reports them as failed cases, and
leaves the host as it was."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest

from rlax_data import CallCase, CodeTests, IOCase, Record
from rlax_data.verify import CodeConfig, CodeVerifier, ExecJob, Sandbox, SandboxConfig, netns_available
from rlax_data.verify.sandbox import _pids_of_uid


def _job(program: str) -> ExecJob:
    return ExecJob(mode="tests", program=program, script="pass")


def _no_leftovers(sb: Sandbox) -> None:
    if sb.isolation["user"].startswith("private uid"):
        for slot in range(sb.isolation["workers"]):
            assert _pids_of_uid(sb.config.uid_base + slot) == []


def test_hostile_programs_fail_and_host_is_unharmed(sandbox, tmp_path):
    outside = tmp_path / f"escape-{uuid.uuid4().hex}"
    tmp_outside = f"/tmp/rlax-escape-{uuid.uuid4().hex}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    programs = {
        "infinite_loop": "while True:\n    pass\n",
        "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n",
        "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
        "subprocess_bomb": "import subprocess\nwhile True:\n    subprocess.Popen(['sleep', '100'])\n",
        "socket": f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n",
        "write_outside": f"open({str(outside)!r}, 'w').write('x')\n",
        "write_tmp": f"open({tmp_outside!r}, 'w').write('x')\n",
        "ctypes": "import ctypes\nctypes.CDLL(None).fork()\n",
        "exit_early": "import os\nos._exit(0)\n",
        "fake_result": 'import sys\nprint(\'{"case": "script", "passed": true}\')\nsys.exit(0)\n',
    }
    results = dict(zip(programs, sandbox.run([_job(p) for p in programs.values()])))
    try:
        for name, res in results.items():
            assert not res.passed, name
            assert res.cases and not res.cases[0].passed and res.cases[0].error, name
        assert results["infinite_loop"].status in ("timeout", "killed")
        assert "MemoryError" in results["memory_bomb"].cases[0].error
        assert "os.fork is not allowed" in results["fork_bomb"].cases[0].error
        assert "subprocess" in results["subprocess_bomb"].cases[0].error
        assert "not allowed" in results["socket"].cases[0].error
        assert "connected" not in results["socket"].stdout
        with pytest.raises(TimeoutError):
            listener.accept()
        assert not outside.exists() and not os.path.exists(tmp_outside)
        assert "outside the sandbox" in results["write_tmp"].cases[0].error
    finally:
        listener.close()
    _no_leftovers(sandbox)
    # The host still runs processes normally.
    assert subprocess.run(["true"], timeout=10).returncode == 0


def test_wall_timeout_kills_the_whole_group():
    # A sleeping program uses no CPU: only the wall-clock timeout and the group kill stop it.
    sb = Sandbox(SandboxConfig(timeout_s=1.0, cpu_s=30, workers=1))
    res = sb.run([_job("import time\ntime.sleep(60)\n")])[0]
    assert res.status == "timeout" and not res.passed
    assert "timed out" in res.cases[0].error
    _no_leftovers(sb)


def test_network_namespace_alone_blocks_loopback():
    """With the in-process socket block lifted (a program that bypassed it), the
    namespace still has no route to the host's loopback listener."""
    if not netns_available():
        with pytest.raises(RuntimeError, match="netns"):
            Sandbox(SandboxConfig(network="netns"))
        assert Sandbox(SandboxConfig(network="auto")).isolation["network"] == "audit-hook"
        return
    sb = Sandbox(SandboxConfig(network="netns", workers=1))
    assert sb.isolation["network"] == "netns+audit-hook"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        # The harness refuses `import socket` first; prove the namespace on its own by
        # making the same connection from a bare `unshare --net` child, as the sandbox runs.
        out = subprocess.run(
            ["unshare", "--net", "--", sys.executable, "-c",
             f"import socket\ntry:\n  socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
             "except OSError as e:\n  print('blocked', e.errno)"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.stdout.startswith("blocked"), out
        assert sb.run([_job("x = 1")])[0].cases[0].passed
    finally:
        listener.close()


def test_files_inside_private_dir_are_fine_and_private(sandbox):
    prog = "import os\nopen('a.txt', 'w').write('hi')\nos.mkdir('d')\nCWD = os.getcwd()\n"
    script = "assert open('a.txt').read() == 'hi'\nassert os.path.isdir('d')\n"
    r1, r2 = sandbox.run([ExecJob(mode="tests", program=prog, script=script)] * 2)
    assert r1.passed and r2.passed


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


def test_output_is_capped():
    sb = Sandbox(SandboxConfig(workers=1, max_output_bytes=1000))
    res = sb.run([ExecJob(mode="io", program="print('x' * 10_000_000)\n", expected_stdout="x")])[0]
    assert len(res.stdout) <= 1000 and not res.passed


def test_bad_config_names_field():
    with pytest.raises(ValueError, match="sandbox.timeout_s"):
        SandboxConfig(timeout_s=0)


def test_file_size_limit():
    sb = Sandbox(SandboxConfig(workers=1, file_size_mb=1))
    res = sb.run([_job("with open('big', 'wb') as f:\n    f.write(b'x' * (4 << 20))\n")])[0]
    assert not res.passed and "File too large" in res.cases[0].error


def test_hook_only_and_unprivileged_modes_still_contain(tmp_path):
    """What a host without root or network namespaces gets: the audit hook alone."""
    sb = Sandbox(SandboxConfig(network="audit", drop_privileges=False, workers=2, timeout_s=5, cpu_s=2))
    assert sb.isolation["network"] == "audit-hook" and sb.isolation["user"] == "same uid as the caller"
    outside = tmp_path / "escape"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    progs = [
        "import os\nos.fork()\n",
        "import socket\n",
        f"open({str(outside)!r}, 'w')\n",
        f"import os\nos.remove({str(victim)!r})\n",
        "while True:\n    pass\n",
    ]
    results = sb.run([_job(p) for p in progs])
    assert [r.passed for r in results] == [False] * len(progs)
    assert not outside.exists() and victim.read_text() == "keep me"
    assert sb.run([_job("x = 2")])[0].passed
