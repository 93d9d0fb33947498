"""Helpers for tests of any package: a parameter server in a thread or in a subprocess.

with running_server(tmp_path) as address:          # in-process, threads
    ParamClient(address, timeout_s=5).push(tree, 1)

with running_server_process(tmp_path) as server:   # a real `rlax-paramserver` process
    server.address; server.kill()                  # e.g. kill -9 mid-push
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from rlax_paramserver.config import ServerConfig
from rlax_paramserver.server import ParamServer


@contextmanager
def running_server(
    state_dir: str | os.PathLike[str] | None = None, *, keep: int = 3, **config: Any
) -> Iterator[str]:
    """Start a `ParamServer` on a free loopback port in this process; yields its address."""
    settings = ServerConfig(bind="tcp://127.0.0.1:*", keep=keep, workers=2, io_threads=1)
    settings = replace(
        settings, state_dir=pathlib.Path(state_dir) if state_dir is not None else None, **config
    )
    server = ParamServer(settings)
    address = server.start()
    try:
        yield address
    finally:
        server.stop()


class ServerProcess:
    """A `rlax-paramserver` subprocess; `address` once it serves."""

    def __init__(self, args: Sequence[str], *, startup_timeout_s: float = 30.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="rlax-ps-")
        ready = pathlib.Path(self._tmp.name) / "address"
        self.log_path = pathlib.Path(self._tmp.name) / "server.log"
        self._log = open(self.log_path, "wb")
        command = [
            sys.executable,
            "-m",
            "rlax_paramserver",
            "--bind",
            "tcp://127.0.0.1:*",
            "--ready-file",
            str(ready),
            *args,
        ]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout_s
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"rlax-paramserver did not start; log:\n{self.log_path.read_text(errors='replace')}"
                )
            time.sleep(0.02)
        self.address = ready.read_text()

    def kill(self) -> None:
        """SIGKILL: no cleanup, no flush — a crash."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        self._tmp.cleanup()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running_server_process(
    state_dir: str | os.PathLike[str] | None = None, *, keep: int = 3, args: Sequence[str] = ()
) -> Iterator[ServerProcess]:
    """Start `rlax-paramserver` as a subprocess on a free loopback port; stops (or reaps) it after."""
    extra = ["--keep", str(keep), "--workers", "2", "--io-threads", "1", *args]
    if state_dir is not None:
        extra += ["--state-dir", str(state_dir)]
    server = ServerProcess(extra)
    try:
        yield server
    finally:
        server.close()
