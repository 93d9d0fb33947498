"""How a sandboxed job is started: the bubblewrap command, the interpreter files it may
see, and a uid of its own (unique on the host) when we run as root.

With bubblewrap every job gets fresh user, pid, network, ipc, uts, cgroup and mount
namespaces: its root is an empty tmpfs holding only read-only binds of the interpreter,
its standard library and the system's shared libraries (every `site-packages` /
`dist-packages` hidden under an empty tmpfs), and a minimal read-only `/dev` (null, zero,
full, random, urandom). No project file, dataset or host `/tmp` is visible; no other
process on the host can be seen or signalled; there is no network interface but a downed
loopback; the job cannot make user namespaces of its own (`--disable-userns`).

The job's writable folders, `/work` (cwd, HOME), `/tmp` and `/dev/shm`, are folders of
one tmpfs bounded in bytes *and* in files (`nr_inodes`, which bubblewrap's `--tmpfs` cannot
set): the runner mounts it itself, in a mount namespace of its own, with the one
capability bubblewrap leaves it (CAP_SYS_ADMIN within the job's user namespace), and
drops that capability before any program code runs (`_harness.py`).
"""

from __future__ import annotations

import fcntl
import functools
import glob
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "BWRAP_MISSING",
    "Interpreter",
    "UidPool",
    "bwrap_command",
    "check_bwrap",
    "find_interpreter",
    "scratch_spec",
]

BWRAP_MISSING = (
    "sandbox.isolation='bwrap' needs bubblewrap (`bwrap`), which is not installed here: install it "
    "(Debian/Ubuntu: apt-get install bubblewrap) or set sandbox.isolation='process' to run programs "
    "with resource limits only (no filesystem, network or process isolation: trusted programs only)"
)

_PROBE = (
    "import json, sys, sysconfig\n"
    "print(json.dumps([sys.version_info[:2], sysconfig.get_path('stdlib'), sysconfig.get_path('platstdlib'),"
    " sysconfig.get_config_var('LIBDIR') or '']))"
)


class Interpreter:
    """A Python interpreter as the sandbox sees it: `executable` (a real path), the paths
    bound read-only, and the package folders hidden under an empty tmpfs."""

    def __init__(self, executable: str, binds: list[str], masks: list[str]) -> None:
        self.executable = executable
        self.binds = binds
        self.masks = masks


def _probe(executable: str) -> tuple[tuple[int, int], list[str]]:
    out = subprocess.run([executable, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"sandbox.python {executable!r} does not run: {out.stderr.strip()[-500:]}")
    version, *paths = json.loads(out.stdout)
    return (version[0], version[1]), [os.path.realpath(p) for p in paths if p]


def _outermost(paths: list[str]) -> list[str]:
    """Existing paths with those nested inside another one dropped, in a stable order."""
    kept: list[str] = []
    for p in sorted({p for p in paths if os.path.exists(p)}, key=lambda s: (len(s), s)):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return kept


@functools.lru_cache(maxsize=16)
def _interpreter_at(executable: str) -> Interpreter:
    exe = os.path.realpath(executable)
    _, paths = _probe(exe)
    # The system's shared libraries (libc, libm, libz, libffi, ...): /usr/lib and /lib*
    # hold nothing of the project; a non-merged /lib is bound as well.
    system = ["/usr/lib", "/usr/lib64", "/usr/lib32"]
    system += [d for d in ("/lib", "/lib64", "/lib32") if os.path.isdir(d) and not os.path.islink(d)]
    binds = _outermost([exe, *paths, *system])
    masks = []
    for root in binds:
        if os.path.isdir(root):
            for pattern in (
                "site-packages",
                "dist-packages",
                "python3*/site-packages",
                "python3*/dist-packages",
            ):
                masks += glob.glob(os.path.join(root, pattern))
    return Interpreter(exe, binds, sorted(set(masks)))


def _readable_by_others(path: str) -> bool:
    """Whether a uid that owns nothing here can read `path` (and traverse to it)."""
    p = Path(path)
    for parent in reversed(p.parents):
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(p).st_mode
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & need == need


def find_interpreter(python: str, private_uid: bool) -> Interpreter:
    """The interpreter jobs run with: `python`, else this one, else (when a private uid
    cannot read this one, say a pyenv under /root) a system Python of the same version."""
    if python:
        interp = _interpreter_at(python)
        candidates = [interp]
    else:
        interp = _interpreter_at(sys.executable)
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        candidates = [interp] + [
            _interpreter_at(p)
            for p in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}")
            if os.path.exists(p)
        ]
    if not private_uid:
        return candidates[0]
    for cand in candidates:
        if all(_readable_by_others(b) for b in cand.binds):
            return cand
    raise RuntimeError(
        f"the sandbox runs programs under a private uid, which cannot read the interpreter "
        f"{interp.executable} or its library ({', '.join(interp.binds)}); set sandbox.python to an "
        "interpreter readable by every user (such as /usr/bin/python3)"
    )


def _bwrap() -> str:
    exe = shutil.which("bwrap")
    if exe is None:
        raise RuntimeError(BWRAP_MISSING)
    return exe


@functools.lru_cache(maxsize=4)
def _bwrap_options(exe: str) -> str:
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def check_bwrap() -> None:
    """Raise unless the installed bubblewrap can run jobs as this module starts them:
    installed, and able to forbid user namespaces inside the job (`--disable-userns`,
    bubblewrap 0.8.0 or later)."""
    exe = _bwrap()
    if "--disable-userns" not in _bwrap_options(exe):
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        raise RuntimeError(
            f"{exe} ({version.strip() or 'unknown version'}) cannot forbid user namespaces inside the "
            "sandbox (`--disable-userns`, bubblewrap 0.8.0 or later): without it a program could "
            "unshare one and mount unbounded file systems. Install bubblewrap 0.8.0 or later"
        )


# The job's writable folders: folders of one tmpfs the runner mounts (see the module docstring).
SCRATCH = ("/work", "/tmp", "/dev/shm")
# Device nodes a program may need; nothing else of the host's /dev.
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def scratch_spec(tmpfs_bytes: int, tmpfs_files: int) -> str:
    """The runner's argument naming the folders to mount and their bounds."""
    return json.dumps({"paths": list(SCRATCH), "bytes": tmpfs_bytes, "files": tmpfs_files})


def bwrap_command(interp: Interpreter, harness: list[str]) -> list[str]:
    """The bubblewrap argv running `interp.executable *harness` in fresh namespaces.
    `harness` must make the runner mount `SCRATCH` (`scratch_spec`): here they are only
    empty folders of the read-only root."""
    cmd = [_bwrap(), "--unshare-all", "--unshare-user", "--disable-userns"]
    # The runner's own mounts need CAP_SYS_ADMIN in the job's user namespace (never the
    # host's); it drops it before the program runs.
    cmd += ["--cap-add", "CAP_SYS_ADMIN", "--die-with-parent", "--new-session", "--clearenv"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/work"), ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8")):
        cmd += ["--setenv", key, value]
    for path in interp.binds:
        cmd += ["--ro-bind", path, path]
    for link in ("/lib", "/lib64", "/lib32"):
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
    for path in interp.masks:
        cmd += ["--tmpfs", path, "--remount-ro", path]
    # A /dev of a few device nodes on the read-only root: nothing in it can be written
    # (bubblewrap's `--dev` is an unbounded tmpfs the job owns, shared memory included).
    for device in _DEVICES:
        cmd += ["--dev-bind", device, device]
    for path in SCRATCH:
        cmd += ["--dir", path]
    cmd += ["--chdir", "/work", "--remount-ro", "/", interp.executable, "-I", "-S", *harness]
    return cmd


_DEFAULT_LOCK_DIR = "/run/lock/rlax-sandbox-uids" if os.path.isdir("/run/lock") else "/tmp/rlax-sandbox-uids"


class UidPool:
    """Uids in [base, base + count) handed out one per job, unique across every process
    on the host: a uid is held by an exclusive `flock` on a file named after it, which
    the kernel releases when the holder closes it or dies."""

    def __init__(self, base: int, count: int, lock_dir: str | None = None) -> None:
        self.base = base
        self.count = count
        # A fixed path (not $TMPDIR, which differs between processes), ours alone.
        self.lock_dir = Path(lock_dir or _DEFAULT_LOCK_DIR)
        self.lock_dir.mkdir(mode=0o700, exist_ok=True)
        st = os.stat(self.lock_dir)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise RuntimeError(
                f"sandbox uid lock folder {self.lock_dir} must be owned by us and not writable by others"
            )
        self._next = 0

    @contextmanager
    def lease(self) -> Iterator[int]:
        for i in range(self.count):
            uid = self.base + (self._next + i) % self.count
            fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._next = (self._next + i + 1) % self.count
            try:
                yield uid
            finally:
                os.close(fd)
            return
        raise RuntimeError(f"all {self.count} sandbox uids from {self.base} are in use on this host")
