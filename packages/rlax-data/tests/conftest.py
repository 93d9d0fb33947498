from __future__ import annotations

import json
import os
import pathlib
import selectors
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from rlax_data.verifier_process import default_routes
from rlax_data.verify import Sandbox, SandboxConfig


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(timeout_s=10, cpu_s=5, memory_mb=512, workers=min(4, os.cpu_count() or 1)))


class VerifierProcess:
    """`rlax-verifier` started as a process of its own on a free loopback port.

    `sandbox`: settings of the code route's sandbox (None: the default routes unchanged,
    no config file). `env`: the process's environment (e.g. a PATH without `bwrap`).
    `address` is what it printed once serving; `stderr` is kept for failure messages.
    """

    def __init__(
        self,
        tmp_path: pathlib.Path,
        *,
        sandbox: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        args = [os.path.join(os.path.dirname(sys.executable), "rlax-verifier"), "--bind", "tcp://127.0.0.1:*"]
        if sandbox is not None:
            routes = msgspec.to_builtins(default_routes())
            routes["routes"]["code"]["sandbox"] = sandbox
            config = tmp_path / "verifier.yaml"
            config.write_text(json.dumps(routes))  # JSON is YAML
            args += ["--config", str(config)]
        self.process = subprocess.Popen(
            [*args, "--poll-s", "0.05"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        # Generous: the service prints its address as soon as it serves, and beside a second
        # full test suite on 2 cores it once took more than 60 s to get there (its imports).
        self.address = self._read_address(startup_timeout_s)

    def _read_address(self, timeout_s: float) -> str:
        assert self.process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        try:
            line = self.process.stdout.readline().strip() if selector.select(timeout_s) else ""
        finally:
            selector.close()
        if not line.startswith("tcp://"):
            self.close()
            raise RuntimeError(
                f"rlax-verifier did not print its address: {line!r}; stderr: {self.stderr()[-2000:]}"
            )
        return line

    def alive(self) -> bool:
        return self.process.poll() is None

    def stderr(self) -> str:
        if self.alive() or self.process.stderr is None or self.process.stderr.closed:
            return ""
        return self.process.stderr.read()

    def close(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def start_verifier(tmp_path: pathlib.Path) -> Iterator[Callable[..., VerifierProcess]]:
    """`start_verifier(sandbox=..., env=...)` -> a running `VerifierProcess`, stopped after the test."""
    started: list[VerifierProcess] = []

    def start(**kwargs: Any) -> VerifierProcess:
        started.append(VerifierProcess(tmp_path, **kwargs))
        return started[-1]

    yield start
    for process in started:
        process.close()
