"""Typed, validated configuration of a parameter server."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from rlax_protocol import CurveServerConfig

DEFAULT_BIND = "tcp://127.0.0.1:5599"


def _check(condition: bool, name: str, value: object, why: str) -> None:
    if not condition:
        raise ValueError(f"ServerConfig.{name}={value!r}: {why}")


@dataclass(frozen=True)
class ServerConfig:
    """Parameter-server settings; every bad field raises ValueError naming field and value.

    bind: ZeroMQ endpoint (``tcp://127.0.0.1:*`` picks a free port).
    keep: how many newest versions to hold (an older one lives on while a pull of it runs).
    state_dir: where the newest `keep` versions are persisted (and restored from on start);
        None keeps everything in memory only.
    fsync: flush each persisted version to the disk (it then survives a machine crash);
        False: written and renamed only (it survives a SIGKILL of any process).
    rest_dir: where the versions rest while the server is stopped, for a `state_dir` in
        memory (a tmpfs such as /dev/shm): a start with an empty `state_dir` copies the
        newest `keep` from here, a stop copies them back and clears `state_dir`. None: the
        versions stay in `state_dir`.
    workers: request-handling threads; io_threads: ZeroMQ I/O threads.
    lease_ttl_s: a pull lease not renewed for this long expires (its client is presumed dead).
    push_idle_timeout_s: a pending push with no chunk for this long is dropped.
    max_frame_bytes: largest single frame accepted (bigger ones drop the connection).
    max_message_bytes: largest total of several frames in one message (a single frame may reach max_frame_bytes).
    max_version_bytes: largest total size of one version.
    max_frames: most frames one version may be split into.
    max_pending_pushes / max_pending_per_client: caps on unfinished pushes.
    max_leases / max_leases_per_client: caps on pulls in flight (a new pull beyond a
        client's cap ends that client's oldest; beyond the total, the oldest of all).
    max_wait_s: longest a WaitNewer long-poll is held before answering.
    max_waiters: most long-polls held at once (beyond it the oldest is answered early).
    client_idle_timeout_s: a client silent for this long must say Hello again.
    insecure: without a credential (`rlax_protocol.auth`), listen beyond loopback anyway
        (None: only if the environment says ``RLAX_INSECURE=1``).
    max_clients: most handshaken connections remembered (beyond it the least recently
        seen must say Hello again), so reconnect churn cannot grow memory.
    """

    bind: str = DEFAULT_BIND
    keep: int = 4  # `paramserver.keep`: one default whether started by `rlax launch` or by hand
    state_dir: pathlib.Path | None = None
    fsync: bool = True
    rest_dir: pathlib.Path | None = None
    workers: int = 4
    io_threads: int = 2
    lease_ttl_s: float = 30.0
    push_idle_timeout_s: float = 120.0
    max_frame_bytes: int = 256 * 1024 * 1024
    max_message_bytes: int = 64 * 1024 * 1024
    max_version_bytes: int = 256 * 1024**3
    max_frames: int = 1 << 20
    max_pending_pushes: int = 16
    max_pending_per_client: int = 2
    max_leases: int = 4096
    max_leases_per_client: int = 4
    max_wait_s: float = 60.0
    max_waiters: int = 4096
    client_idle_timeout_s: float = 600.0
    max_clients: int = 4096
    server_id: str = "rlax-paramserver"
    insecure: bool | None = None
    curve: CurveServerConfig | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check(
            "://" in self.bind, "bind", self.bind, "must be a ZeroMQ endpoint such as tcp://127.0.0.1:5599"
        )
        _check(self.keep >= 1, "keep", self.keep, "must be >= 1 (the newest version is always kept)")
        _check(self.workers >= 1, "workers", self.workers, "must be >= 1")
        _check(self.io_threads >= 1, "io_threads", self.io_threads, "must be >= 1")
        for name in ("lease_ttl_s", "push_idle_timeout_s", "max_wait_s", "client_idle_timeout_s"):
            value = getattr(self, name)
            _check(value > 0, name, value, "must be > 0")
        for name in (
            "max_frame_bytes",
            "max_message_bytes",
            "max_version_bytes",
            "max_frames",
            "max_pending_pushes",
            "max_pending_per_client",
            "max_waiters",
            "max_clients",
            "max_leases",
            "max_leases_per_client",
        ):
            value = getattr(self, name)
            _check(value > 0, name, value, "must be > 0")
        if self.state_dir is not None:
            _check(
                not self.state_dir.is_file(),
                "state_dir",
                str(self.state_dir),
                "is a file, expected a directory",
            )
        if self.rest_dir is not None:
            _check(self.state_dir is not None, "rest_dir", str(self.rest_dir), "needs a state_dir")
            _check(
                not self.rest_dir.is_file(), "rest_dir", str(self.rest_dir), "is a file, expected a directory"
            )
            _check(
                self.state_dir is None or self.rest_dir.resolve() != self.state_dir.resolve(),
                "rest_dir",
                str(self.rest_dir),
                "must differ from state_dir",
            )
