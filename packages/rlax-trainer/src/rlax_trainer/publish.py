"""Publishing weights to the parameter server: version = step, in a transfer dtype.

The learner's loop only copies the weights to host memory (that must finish before the
next update reuses the device buffers); an I/O thread encodes and pushes them, so the
compute loop never waits on a socket. At most one push is in flight and one waits: a
newer version published while one still waits replaces it (the server serves the
latest, and host copies of the weights stay bounded), which is logged and recorded in
`Publisher.superseded`. A failed push never stops the pushes after it; its error is
raised at the next `publish`, `wait` or `close`, never swallowed.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal, NamedTuple

import jax
import ml_dtypes
import msgspec
import numpy as np

from rlax_paramserver import ParamClient
from rlax_protocol import Committed
from rlax_trainer.sharding import to_host

__all__ = ["PublishConfig", "Publisher", "host_weights"]

log = logging.getLogger(__name__)

TransferDtype = Literal["bfloat16", "float16", "float32"]
_NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


class PublishConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Push every `every` steps (version = step) to the server at `address`, as `dtype`."""

    address: str
    every: int = 1
    dtype: TransferDtype = "bfloat16"
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"address must be a ZeroMQ endpoint like tcp://127.0.0.1:5555, got {self.address!r}"
            )


def host_weights(params: Any, dtype: TransferDtype = "bfloat16") -> dict[str, Any]:
    """Global (possibly multi-process) param arrays -> nested dict of numpy arrays in `dtype`."""
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"transfer dtype must be one of {sorted(_NUMPY_DTYPES)}, got {dtype!r}")
    target = _NUMPY_DTYPES[dtype]
    host = to_host(params)
    out: dict[str, Any] = jax.tree.map(lambda x: np.ascontiguousarray(np.asarray(x).astype(target)), host)
    return out


class _Push(NamedTuple):
    tree: dict[str, Any]
    version: int
    metadata: dict[str, Any]


class Publisher:
    """Pushes weights after updates. Only process 0 talks to the server; every process must
    call `publish` (the weights may be spread over processes)."""

    def __init__(self, config: PublishConfig, *, client: ParamClient | None = None) -> None:
        self.config = config
        self._is_writer = jax.process_index() == 0
        self._client = client
        if self._is_writer and self._client is None:
            self._client = ParamClient(config.address, timeout_s=config.timeout_s, client_id="trainer")
        self._cond = threading.Condition()
        self._waiting: _Push | None = None  # queued, its push not started
        self._in_flight: int | None = None  # the version being pushed
        self._closing = False
        self._failures: list[tuple[int, BaseException]] = []
        self.committed: list[Committed] = []
        self.superseded: list[int] = []  # versions replaced by a newer one before their push began
        self._thread = threading.Thread(target=self._run, name="rlax-publisher", daemon=True)
        if self._is_writer:
            self._thread.start()

    def _run(self) -> None:
        client = self._client
        assert client is not None  # the writer, the only process running this thread, has one
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None or self._closing)
                if self._waiting is None:
                    return
                item, self._waiting = self._waiting, None
                self._in_flight = item.version
            try:
                committed = client.push(item.tree, item.version, item.metadata)
            except BaseException as e:  # recorded and raised in the caller's thread
                log.warning("publishing weights version %d failed: %s", item.version, e)
                with self._cond:
                    self._failures.append((item.version, e))
            else:
                log.info("published weights version %d", item.version)
                with self._cond:
                    self.committed.append(committed)
            finally:
                with self._cond:
                    self._in_flight = None
                    self._cond.notify_all()

    def _raise_pending(self) -> None:
        with self._cond:
            failures, self._failures = self._failures, []
        if failures:
            versions = ", ".join(str(v) for v, _ in failures)
            first = failures[0][1]
            raise RuntimeError(
                f"publishing weights to {self.config.address} failed for version(s) {versions}: {first}"
            ) from first

    def _wait_idle(self) -> None:
        with self._cond:
            while self._waiting is not None or self._in_flight is not None:
                if not self._thread.is_alive():
                    raise RuntimeError("the publisher thread has stopped with pushes outstanding")
                # The push itself is bounded by the client's timeout; re-check the thread now and then.
                self._cond.wait(timeout=1.0)

    def due(self, step: int) -> bool:
        return step % self.config.every == 0

    def publish(
        self, params: Any, step: int, metadata: dict[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Publish `params` as version `step` if due (or `force`); returns whether it was queued.

        Never waits for a push: a version still waiting is replaced by this one. Raises
        (before queuing) the error of any push that failed since the last call."""
        self._raise_pending()
        if not (force or self.due(step)):
            return False
        tree = host_weights(params, self.config.dtype)
        if self._is_writer:
            meta = {"step": int(step), "dtype": self.config.dtype, **(metadata or {})}
            with self._cond:
                if self._closing:
                    raise RuntimeError("publish after close")
                if self._waiting is not None:
                    log.info(
                        "weights version %d superseded by %d before its push began",
                        self._waiting.version,
                        step,
                    )
                    self.superseded.append(self._waiting.version)
                self._waiting = _Push(tree, int(step), meta)
                self._cond.notify_all()
        return True

    def wait(self) -> None:
        """Block until the waiting and in-flight pushes finished; raises a failed push's error."""
        if self._is_writer:
            self._wait_idle()
        self._raise_pending()

    def close(self) -> None:
        try:
            if self._is_writer and self._thread.is_alive():
                self._wait_idle()
                with self._cond:
                    self._closing = True
                    self._cond.notify_all()
                self._thread.join(timeout=self.config.timeout_s)
        finally:
            if self._client is not None:
                self._client.close()
        self._raise_pending()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
