"""Publishing weights to the parameter server: version = step, in a transfer dtype.

The learner's loop only copies the weights to host memory (that must finish before the
next update reuses the device buffers); an I/O thread encodes and pushes them, so the
compute loop never waits on a socket. A failed push is raised at the next `publish`
or `wait`, never swallowed.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Literal

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
    return jax.tree.map(lambda x: np.ascontiguousarray(np.asarray(x).astype(target)), host)


class Publisher:
    """Pushes weights after updates. Only process 0 talks to the server; every process must
    call `publish` (the weights may be spread over processes)."""

    def __init__(self, config: PublishConfig, *, client: ParamClient | None = None) -> None:
        self.config = config
        self._is_writer = jax.process_index() == 0
        self._client = client
        if self._is_writer and self._client is None:
            self._client = ParamClient(config.address, timeout_s=config.timeout_s, client_id="trainer")
        self._queue: queue.Queue[tuple[dict[str, Any], int, dict[str, Any]] | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self.committed: list[Committed] = []
        self._thread = threading.Thread(target=self._run, name="rlax-publisher", daemon=True)
        if self._is_writer:
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                tree, version, metadata = item
                if self._error is None:
                    self.committed.append(self._client.push(tree, version, metadata))
                    log.info("published weights version %d", version)
            except BaseException as e:
                self._error = e
            finally:
                self._queue.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"publishing weights to {self.config.address} failed: {err}") from err

    def due(self, step: int) -> bool:
        return step % self.config.every == 0

    def publish(
        self, params: Any, step: int, metadata: dict[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Publish `params` as version `step` if due (or `force`); returns whether it was queued."""
        self._raise_pending()
        if not (force or self.due(step)):
            return False
        tree = host_weights(params, self.config.dtype)
        if self._is_writer:
            meta = {"step": int(step), "dtype": self.config.dtype, **(metadata or {})}
            self._queue.put((tree, int(step), meta))
        return True

    def wait(self) -> None:
        """Block until every queued push committed; raises a failed push's error."""
        if self._is_writer:
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        if self._is_writer and self._thread.is_alive():
            self._queue.join()
            self._queue.put(None)
            self._thread.join(timeout=self.config.timeout_s)
        if self._client is not None:
            self._client.close()
        self._raise_pending()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
