"""What a sandboxed job may take from the host, and for how long: shared memory and files
count against the job's folder limits, no process of a job outlives `Sandbox.run()`, a job
cannot make user namespaces (nor keep the capability its runner mounts with), and a
verifier whose routes run no code needs no bubblewrap."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest

import rlax_protocol as rp
from rlax_data import CallCase, CodeTests, Record
from rlax_data.tasks import ArithmeticTask
from rlax_data.verifier_process import RemoteVerifier, default_routes
from rlax_data.verify import ExecJob, Sandbox, SandboxConfig, build_verifier

# A uid range of this module's own, so that jobs of other tests (or other test runs on
# the host) never count as ours.
_UID_BASE = 400_000 + (os.getpid() % 1000) * 64
_UID_COUNT = 64


def _shmem_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


def test_shared_memory_and_files_count_against_the_job_limits():
    sb = Sandbox(
        SandboxConfig(workers=1, timeout_s=60, cpu_s=30, memory_mb=1024, file_size_mb=64, tmpfs_mb=64,
                      tmpfs_files=4096, uid_base=_UID_BASE, uid_count=_UID_COUNT)
    )  # fmt: skip
    # 600 MB to /dev/shm in 30 MB files (each under the file size limit), then 196,000
    # empty files (kernel memory, not Shmem), then a file in /dev itself.
    program = (
        "import os\n"
        "def f(what):\n"
        "    if what == 'bytes':\n"
        "        for k in range(20):\n"
        "            with open(f'/dev/shm/big{k}', 'wb') as fh:\n"
        "                for _ in range(30):\n"
        "                    fh.write(b'x' * (1 << 20))\n"
        "    elif what == 'files':\n"
        "        for i in range(196_000):\n"
        "            open(f'/dev/shm/f{i}', 'w').close()\n"
        "    else:\n"
        "        open('/dev/rlax-file', 'w').close()\n"
        "    return 'no limit'\n"
    )
    job = ExecJob(
        mode="tests",
        program=program,
        entry_point="f",
        calls=[{"args": [what], "kwargs": {}, "expected": "limited"} for what in ("bytes", "files", "dev")],
    )
    base, peak, done = _shmem_kb(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _shmem_kb() - base)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        res = sb.run([job])[0]
    finally:
        done.set()
        watcher.join()
    assert peak[0] <= 100 * 1024, f"host shared memory rose {peak[0] / 1024:.0f} MB"
    by_bytes, by_files, in_dev = res.cases
    for case in (by_bytes, by_files):
        assert not case.passed and "No space left on device" in case.error, case.error
        assert "files limit: 64 MB and 4096 files in all of /work, /tmp and /dev/shm" in case.error
    assert not in_dev.passed and "Read-only file system" in in_dev.error, in_dev.error


def _job_processes(marker: str) -> list[str]:
    """Processes of this module's uid range (any state: a zombie counts) or whose command
    line holds `marker`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            uid = entry.stat().st_uid
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (os.geteuid() == 0 and _UID_BASE <= uid < _UID_BASE + _UID_COUNT) or marker.encode() in cmdline:
            found.append(f"pid {entry.name} uid {uid} state {state}")
    return found


def test_no_process_of_a_job_outlives_run():
    sb = Sandbox(
        SandboxConfig(workers=2, timeout_s=20, max_procs=8, uid_base=_UID_BASE, uid_count=_UID_COUNT)
    )
    marker = f"rlax-daemon-{uuid.uuid4().hex}"
    # Daemons: forked twice, in a session of their own, deaf to SIGTERM and SIGHUP.
    program = (
        "import os, signal, sys, time\n"
        "def f():\n"
        "    for _ in range(2):\n"
        "        if os.fork() == 0:\n"
        "            if os.fork() == 0:\n"
        "                os.setsid()\n"
        "                signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "                signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        f"                os.execv(sys.executable, [sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.01)', {marker!r}])\n"
        "            os._exit(0)\n"
        "        os.wait()\n"
        "    time.sleep(0.05)\n"
        "    return 1\n"
    )
    job = ExecJob(
        mode="tests", program=program, entry_point="f", calls=[{"args": [], "kwargs": {}, "expected": 1}]
    )
    io_job = ExecJob(mode="io", program=program + "f()\n", expected_stdout="")
    assert _job_processes(marker) == []
    outlived = []
    for _ in range(10):  # 20 jobs
        results = sb.run([job, io_job])
        assert results[0].passed and results[1].passed, [(r.status, r.reason, r.cases) for r in results]
        left = _job_processes(marker)
        outlived.append(len(left))
        # Wait for any survivors to go before the next run, so that each run is counted alone
        # (the deadline bounds the wait only; survivors already failed this run's count).
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = _job_processes(marker)
    assert outlived == [0] * 10, (outlived, _job_processes(marker))


def test_the_job_cannot_make_user_namespaces_nor_mount(sandbox):
    program = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "class Header(ctypes.Structure):\n"
        "    _fields_ = [('version', ctypes.c_uint32), ('pid', ctypes.c_int)]\n"
        "def f():\n"
        "    out = {}\n"
        "    if hasattr(os, 'unshare'):\n"
        "        try:\n"
        "            os.unshare(os.CLONE_NEWUSER)\n"
        "            out['os.unshare'] = 'made a user namespace'\n"
        "        except OSError:\n"
        "            out['os.unshare'] = 'refused'\n"
        "    else:\n"
        "        out['os.unshare'] = 'refused' if libc.unshare(0x10000000) != 0 else 'made a user namespace'\n"
        "    out['mount ns'] = 'refused' if libc.unshare(0x00020000) != 0 else 'made a mount namespace'\n"
        "    out['mount'] = 'refused' if libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, b'size=1g') != 0 else 'mounted'\n"
        "    caps = (ctypes.c_uint32 * 6)()\n"
        "    libc.capget(ctypes.byref(Header(0x20080522, 0)), caps)\n"
        "    out['capabilities'] = list(caps)\n"
        "    out['dev'] = sorted(os.listdir('/dev'))\n"
        "    return out\n"
    )
    expected = {
        "os.unshare": "refused",
        "mount ns": "refused",
        "mount": "refused",
        "capabilities": [0] * 6,
        "dev": ["full", "null", "random", "shm", "urandom", "zero"],
    }
    job = ExecJob(
        mode="tests",
        program=program,
        entry_point="f",
        calls=[{"args": [], "kwargs": {}, "expected": expected}],
    )
    res = sandbox.run([job])[0]
    assert res.passed, res.cases


def test_the_job_folders_are_still_usable(sandbox):
    """Bounded folders, not broken ones: files in /work, /tmp and /dev/shm, and
    multiprocessing's semaphores (which live in /dev/shm)."""
    program = (
        "import multiprocessing, os\n"
        "def f():\n"
        "    for d in ('/work', '/tmp', '/dev/shm'):\n"
        "        with open(os.path.join(d, 'x'), 'w') as fh:\n"
        "            fh.write(d)\n"
        "    lock = multiprocessing.Lock()\n"
        "    with lock:\n"
        "        pass\n"
        "    return [open(os.path.join(d, 'x')).read() for d in ('/work', '/tmp', '/dev/shm')] + [os.getcwd()]\n"
    )
    job = ExecJob(mode="tests", program=program, entry_point="f",
                  calls=[{"args": [], "kwargs": {}, "expected": ["/work", "/tmp", "/dev/shm", "/work"]}])  # fmt: skip
    res = sandbox.run([job])[0]
    assert res.passed, res.cases


def _path_without_bwrap(tmp_path: Path) -> str:
    """A PATH on which `bwrap` is not found (this interpreter's folder only)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("python", "python3"):
        (folder / name).symlink_to(sys.executable)
    return str(folder)


def _code_record() -> Record:
    return Record(id="sq", prompt="square", task="code",
                  tests=CodeTests(entry_point="sq", calls=[CallCase(args=[3], expected=9)]))  # fmt: skip


def test_routes_that_run_no_code_need_no_bubblewrap(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _path_without_bwrap(tmp_path))
    assert shutil.which("bwrap") is None
    verifier = build_verifier(default_routes())  # builds every route, code included
    arith = ArithmeticTask().generate(2, seed=0)
    good, bad = verifier.verify([(arith[0].answer, arith[0]), ("not a number", arith[1])])
    assert good.correct and not bad.correct
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
        verifier.verify([("def sq(x):\n    return x * x\n", _code_record())])


def test_the_verifier_service_starts_without_bubblewrap(tmp_path, start_verifier):
    """`rlax-verifier` with its default routes on a host without `bwrap`: arithmetic and
    exact match are served, and a code item is refused with what to install."""
    service = start_verifier(env={**os.environ, "PATH": _path_without_bwrap(tmp_path)})
    remote = RemoteVerifier(service.address, timeout_s=60)
    try:
        arith = ArithmeticTask().generate(1, seed=1)[0]
        exact = Record(id="e", prompt="p", answer="yes", task="exact_match")
        got = remote.verify([(arith.answer, arith), ("yes", exact), ("no", exact)])
        assert [r.correct for r in got] == [True, True, False]
        with pytest.raises(rp.RemoteError, match="apt-get install bubblewrap"):
            remote.verify([("def sq(x):\n    return x * x\n", _code_record())])
        # And it still serves after refusing.
        assert remote.verify([("yes", exact)])[0].correct
    finally:
        remote.close()


def test_a_bubblewrap_that_cannot_disable_user_namespaces_is_refused(tmp_path, monkeypatch):
    """An old bubblewrap (before 0.8.0) would let jobs make user namespaces: fail closed."""
    from rlax_data.verify import _isolation

    old = tmp_path / "bwrap"
    old.write_text(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'bubblewrap 0.6.1'; else echo '--unshare-user'; fi\n"
    )
    old.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    _isolation._bwrap_options.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"0\.6\.1.*--disable-userns.*0\.8\.0"):
            Sandbox(SandboxConfig(workers=1))
    finally:
        _isolation._bwrap_options.cache_clear()


def test_config_names_the_files_limit():
    with pytest.raises(ValueError, match="sandbox.tmpfs_files"):
        SandboxConfig(tmpfs_files=0)
    assert json.loads(msgspec.json.encode(SandboxConfig()))["tmpfs_files"] == 4096
