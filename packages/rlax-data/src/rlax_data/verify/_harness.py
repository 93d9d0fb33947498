"""Child-side runner, executed inside the sandbox (never imported by the verifier).

`sandbox.py` runs `python -I -S -c <plain_values.py + this file> REQUEST_FD REPLY_FD
STATUS_FD [SCRATCH]`. With SCRATCH (bubblewrap jobs: JSON {"paths", "bytes", "files"}),
the runner first mounts one tmpfs bounded in bytes and in files and binds a folder of it
on each of those paths (so they share the bounds), in a mount namespace of its own, then
drops every capability (bubblewrap leaves it CAP_SYS_ADMIN of the job's user namespace for
this alone) and checks that none is left, before it reads the program.
Nothing here is trusted by the judging side: the program runs in this same process and
may rewrite any of it. The design does not need it to be trusted, because
- the expected values never enter the sandbox (only call arguments do), and
- the parent checks the returned *values*, decoded from JSON as built-in types, never a
  pass flag; a forged reply is only a (probably wrong) answer.

The same runner also runs a dataset's test script (mode "judge", in a sandbox of its
own that holds no program): it sends {"call": {"args", "kwargs"}} for each call of the
entry point, gets back what the program's sandbox replied, and ends with {"done": true}
or {"done": false, "error"}.

Messages are JSON lines. Request 1: {"mode", "program", "entry_point", "limits"}.
Mode "io" (and "run", whose output nobody judges): run the program and exit with its
status (stdout is what gets judged).
Mode "tests": reply {"loaded": true} or {"loaded": false, "error", "type"} after running
the program; then for each request {"args", "kwargs"} call `entry_point` and reply
{"value": plain} or {"error", "type", "errno"}; end at EOF.

As in `plain_values.py` (which runs before this file, in one source), `typing` is
imported for the type checker only: annotations that name it are strings.
"""

import json
import os
import resource
import sys
import traceback
import types

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, TypedDict

    from rlax_data.verify.plain_values import from_plain, to_plain

    class _Failure(TypedDict):
        error: str
        type: str
        errno: int | None


def _set_limits(limits: "dict[str, int]") -> None:
    def both(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    # The CPU hard limit sits one second above the soft one: SIGXCPU first, then SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    both(resource.RLIMIT_AS, limits["as_bytes"])
    both(resource.RLIMIT_FSIZE, limits["fsize_bytes"])
    both(resource.RLIMIT_NOFILE, limits["nofile"])
    both(resource.RLIMIT_CORE, 0)
    both(resource.RLIMIT_NPROC, limits["nproc"])


class _Lines:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def next(self) -> "Any":
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def _send(fd: int, obj: object) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    data = (json.dumps(obj, allow_nan=False) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _failure(exc: BaseException) -> "_Failure":
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
    return {"error": text, "type": type(exc).__name__, "errno": getattr(exc, "errno", None)}


def _exception_for(reply: "dict[str, Any]") -> Exception:
    """The exception a failed call raises in the tests: the built-in class of that name
    (so tests that expect, say, a ValueError work), else a plain Exception."""
    import builtins

    kind = getattr(builtins, str(reply.get("type")), None)
    message = str(reply.get("error", ""))[-500:]
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:
            pass
    return Exception(message)


def _tests_failure(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<tests>"]
    where = f" (tests line {frames[-1].lineno})" if frames else ""
    return ("".join(traceback.format_exception_only(type(exc), exc)).strip() + where)[-2000:]


def _run_judge(spec: "dict[str, Any]", requests: _Lines, reply_fd: int) -> None:
    """The tests' process (no program in it): run the dataset's test script with the
    entry point standing for the program, which the verifier calls in the other
    sandbox; every value that comes back is plain data."""
    import random

    # Tests that draw random cases get the same cases for every sample of a problem.
    random.seed(spec["seed"])
    namespace: dict[str, object] = {"__name__": "__rlax_tests__"}

    def candidate(*args: "Any", **kwargs: "Any") -> "Any":
        _send(reply_fd, {"call": {"args": to_plain(list(args)), "kwargs": to_plain(dict(kwargs))}})
        reply = requests.next()
        if reply is None:
            os._exit(1)  # the verifier stopped the job
        if "value" in reply:
            return from_plain(reply["value"])
        raise _exception_for(reply)

    try:
        exec(compile(spec["prelude"], "<prelude>", "exec"), namespace)
    except BaseException as exc:
        _send(reply_fd, {"done": False, "error": "the tests' prelude failed: " + _failure(exc)["error"]})
        return
    if spec["entry_point"]:
        namespace[spec["entry_point"]] = candidate
    try:
        exec(compile(spec["script"], "<tests>", "exec"), namespace)
    except BaseException as exc:
        _send(reply_fd, {"done": False, "error": _tests_failure(exc)})
        return
    _send(reply_fd, {"done": True})


def _run_program(spec: "dict[str, Any]", requests: _Lines, reply_fd: int) -> None:
    """The program's process: limits, then the program, then its test calls."""
    _set_limits(spec["limits"])
    if spec["mode"] == "judge":
        _run_judge(spec, requests, reply_fd)
        return
    # The program gets a fresh `__main__` module of its own.
    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module
    if spec["mode"] in ("io", "run"):
        os.close(requests.fd)
        os.close(reply_fd)
        exec(compile(spec["program"], "<program>", "exec"), module.__dict__)
        return
    try:
        exec(compile(spec["program"], "<program>", "exec"), module.__dict__)
    except BaseException as exc:
        _send(reply_fd, {"loaded": False, **_failure(exc)})
        return
    _send(reply_fd, {"loaded": True})
    entry_point = spec["entry_point"]
    while True:
        call = requests.next()
        if call is None:
            return
        try:
            function = module.__dict__.get(entry_point)
            if not callable(function):
                raise NameError(f"the program does not define a function {entry_point!r}")
            value = function(*from_plain(call["args"]), **from_plain(call["kwargs"]))
            reply: Mapping[str, object] = {"value": to_plain(value)}
        except BaseException as exc:
            reply = _failure(exc)
        _send(reply_fd, reply)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _mount_scratch(scratch: "dict[str, Any]") -> None:
    """Mount the job's writable folders (folders of one bounded tmpfs), then drop every
    capability. Any failure ends the job: a job with unbounded folders, or that keeps a
    capability, does not run."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")

    clone_newns, ms_nosuid, ms_nodev, ms_bind = 0x00020000, 0x2, 0x4, 0x1000
    # A mount namespace of our own: bubblewrap's belongs to the user namespace above ours
    # (--disable-userns nests one), where our capability does not reach.
    check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
    options = f"size={int(scratch['bytes'])},nr_inodes={int(scratch['files'])},mode=0755".encode()
    # The tmpfs goes on the last path first; each path then gets a folder of it, the last
    # path's over the tmpfs itself (which stays mounted underneath, out of sight).
    paths = scratch["paths"]
    base = paths[-1]
    check(
        libc.mount(b"tmpfs", base.encode(), b"tmpfs", ms_nosuid | ms_nodev, options), f"mount tmpfs on {base}"
    )
    for i in range(len(paths)):
        os.mkdir(f"{base}/{i}", 0o755)
    for i, path in enumerate(paths):
        check(libc.mount(f"{base}/{i}".encode(), path.encode(), None, ms_bind, None), f"bind {path}")
    os.chdir("/work")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two words each
    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    pr_set_no_new_privs, pr_cap_ambient, pr_cap_ambient_clear_all = 38, 47, 4
    check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    check(libc.prctl(pr_cap_ambient, pr_cap_ambient_clear_all, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    check(libc.capset(ctypes.byref(header), sets), "capset")
    left = (ctypes.c_uint32 * 6)(*([1] * 6))
    check(libc.capget(ctypes.byref(Header(0x20080522, 0)), left), "capget")
    if any(left):
        raise OSError(0, f"capabilities left after dropping them: {list(left)}")


def _main() -> None:
    request_fd, reply_fd, status_fd = (int(a) for a in sys.argv[1:4])
    if len(sys.argv) > 4:
        try:
            _mount_scratch(json.loads(sys.argv[4]))
        except BaseException as exc:
            sys.stderr.write(f"the sandbox could not set up the job's folders: {exc}\n")
            os._exit(125)
    requests = _Lines(request_fd)
    spec = requests.next()
    # The program runs in a child; this process only reports how it ended and the CPU
    # time it used (through `status_fd`, which the child does not keep), so that a kill
    # can be told apart: a limit of the job's own, or a signal from outside.
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        code = 0
        try:
            _run_program(spec, requests, reply_fd)
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)
    os.close(request_fd)
    os.close(reply_fd)
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    _send(status_fd, {"exit": code, "cpu_s": usage.ru_utime + usage.ru_stime})
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    _main()
