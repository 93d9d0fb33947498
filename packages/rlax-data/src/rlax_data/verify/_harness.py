"""Child-side sandbox harness (run as a script by `sandbox.py`, never imported by it).

Order matters: read the spec (still privileged), set resource limits, import the stdlib
modules user code may need, drop to the sandbox uid, install the audit hook, then run
the user program. Results go to an inherited pipe fd as JSON lines that carry a nonce,
so text a program prints can never pass for a result.

Only the standard library is used: the interpreter runs with -I -S.
"""

import json
import os
import resource
import sys

SPEC_PATH = sys.argv[1]
RESULT_FD = int(sys.argv[2])

with open(SPEC_PATH, "rb") as _f:
    SPEC = json.loads(_f.read())
os.unlink(SPEC_PATH)
NONCE = SPEC.pop("nonce")
LIMITS = SPEC["limits"]
SANDBOX_DIR = os.path.realpath(SPEC["sandbox_dir"])


def _emit(obj):
    obj["nonce"] = NONCE
    data = (json.dumps(obj, default=repr) + "\n").encode()
    while data:
        n = os.write(RESULT_FD, data)
        data = data[n:]


def _set_limits():
    def both(which, value):
        resource.setrlimit(which, (value, value))

    # The CPU hard limit sits one second above the soft one: SIGXCPU first, then SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (LIMITS["cpu_s"], LIMITS["cpu_s"] + 1))
    both(resource.RLIMIT_AS, LIMITS["as_bytes"])
    both(resource.RLIMIT_FSIZE, LIMITS["fsize_bytes"])
    both(resource.RLIMIT_NOFILE, LIMITS["nofile"])
    both(resource.RLIMIT_CORE, 0)
    both(resource.RLIMIT_NPROC, LIMITS["nproc"])


_set_limits()

for _name in SPEC["preload"]:
    __import__(_name)

import traceback  # noqa: E402  (after the limits, so its import is limited too)

if SPEC["uid"] is not None:
    os.setgroups([])
    os.setgid(SPEC["gid"])
    os.setuid(SPEC["uid"])
os.chdir(SANDBOX_DIR)

_BLOCKED_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "os.exec",
    "os.startfile",
    "subprocess.Popen",
    "pty.spawn",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
    "ctypes.call_function",
    "os.chroot",
    "os.setuid",
    "os.setreuid",
    "os.setresuid",
}
# Modules that reach the OS without raising an audit event of their own.
_BLOCKED_IMPORTS = {"_posixsubprocess", "_ctypes", "ctypes", "_multiprocessing"}
if SPEC["block_network"]:
    _BLOCKED_EVENTS |= {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"}
    _BLOCKED_IMPORTS |= {"_socket", "socket", "ssl", "_ssl"}
_PATH_EVENTS = {
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.utime",
    "os.link",
    "os.symlink",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _inside(path):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    real = os.path.realpath(os.fspath(path))
    return real == SANDBOX_DIR or real.startswith(SANDBOX_DIR + os.sep) or real == "/dev/null"


def _hook(event, args):
    if event in _BLOCKED_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in _BLOCKED_IMPORTS:
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS
        )
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in _PATH_EVENTS:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError(f"sandbox: {event} on {p!r} outside the sandbox directory")


sys.addaudithook(_hook)


def _error_text():
    etype, value, _ = sys.exc_info()
    lines = traceback.format_exception_only(etype, value)
    return "".join(lines).strip()[-2000:]


def _plain(value):
    # JSON round trip: tuples become lists, so results compare like the stored expectation.
    return json.loads(json.dumps(value))


def _run():
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    mode = SPEC["mode"]
    try:
        exec(compile(SPEC["program"], "<program>", "exec"), namespace)
    except SystemExit as e:
        if mode == "io" and (e.code is None or e.code == 0):
            _emit({"case": "io", "passed": True})
            return
        raise
    except BaseException:
        if mode == "io":
            _emit({"case": "io", "passed": False, "error": _error_text()})
            return
        msg = _error_text()
        for case in SPEC["cases"]:
            _emit({"case": case, "passed": False, "error": "program failed: " + msg})
        return
    if mode == "io":
        sys.stdout.flush()
        _emit({"case": "io", "passed": True})
        return
    for case in SPEC["cases"]:
        try:
            if case == "script":
                exec(compile(SPEC["script"], "<tests>", "exec"), namespace)
                _emit({"case": case, "passed": True})
            else:
                call = SPEC["calls"][case]
                fn = namespace[SPEC["entry_point"]]
                got = _plain(fn(*call["args"], **call["kwargs"]))
                ok = got == call["expected"]
                out = {"case": case, "passed": ok}
                if not ok:
                    out["error"] = f"expected {call['expected']!r}, got {got!r}"[:2000]
                _emit(out)
        except BaseException:
            _emit({"case": case, "passed": False, "error": _error_text()})


_run()
sys.stdout.flush()
