"""The trainer's pushes to the parameter server: the weights of a step (a LoRA run's
adapters alone, on a base pushed once), unless the parameter server holds that version
already, retrying while it restarts.

Every process of a trainer gang calls `WeightPusher.publish` (gathering the weights is a
collective); the leader alone decides whether a push is needed, tells the others, and pushes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from rlax_paramserver import ParamClient, StaleVersionError
from rlax_protocol.errors import ProtocolTimeoutError
from rlax_protocol.lora_versions import (
    LORA_BASE_SHA256,
    LORA_BASE_VERSION,
    LORA_RANK,
    LORA_SCALE,
    LORA_TARGETS,
    tree_sha256,
)
from rlax_trainer.gang import Gang

__all__ = ["WeightPusher", "to_numpy_tree"]

log = logging.getLogger("rlax.trainer")


def to_numpy_tree(tree: Any, dtype: str) -> Any:
    """The arrays of `tree` as numpy arrays of `dtype` ("float32" or "bfloat16")."""
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    # copy=False: a float32 publish of float32 params sends the host arrays as they are
    # (a second copy of the policy was the trainer's peak on SmolLM2).
    return jax.tree.map(lambda x: np.asarray(x).astype(target, copy=False), tree)


class WeightPusher:
    """Pushes the policy of a step as weight version = step.

    client: the leader's parameter-server client (None on the other processes); address: the
    parameter server's, for messages; timeout_s: how long a push keeps retrying
    (`controller.request_timeout_s`); dtype: the pushed weights' dtype (`trainer.publish_dtype`).
    """

    def __init__(
        self, gang: Gang, client: ParamClient | None, *, address: str, timeout_s: float, dtype: str
    ) -> None:
        self.gang = gang
        self.client = client
        self.address = address
        self.timeout_s = timeout_s
        self.dtype = dtype
        self._base_sha256: str | None = None  # a LoRA run's base, as pushed (computed once)

    def publish(self, step: int, policy_on_host: Callable[[], Any]) -> None:
        """Push the weights of `step` unless the parameter server already has them, retrying
        while it restarts (up to `timeout_s`). `policy_on_host()`: the policy's params on
        this host (a gather across the gang, which every process runs)."""
        needed = self.gang.broadcast_flag(self._needs_push(step) if self.gang.leader else None)
        if not needed:
            return
        tree = to_numpy_tree(policy_on_host(), self.dtype)
        if self.gang.leader:
            self._retrying(step, lambda: self._push(step, tree))

    def publish_adapters(
        self,
        step: int,
        base_on_host: Callable[[], Any],
        adapters_on_host: Callable[[], Any],
        scale: float,
    ) -> None:
        """A LoRA run's version `step` (`rlax_protocol.lora_versions`): the frozen base once,
        as version 0, when the parameter server holds nothing (a fresh run, or a server
        that lost its state); otherwise the adapters alone, in `publish_dtype` like the base
        (rounding A and B to bfloat16 moves the merged weights by ~2^-8 of the adapters'
        small delta, far less than rounding W itself does to a full version), on base
        version 0. `base_on_host()` and `adapters_on_host()` gather across the gang:
        every process calls this."""
        latest = self._retrying(step, self.client.latest) if self.gang.leader and self.client else None
        needed = self.gang.broadcast_flag(latest is None or latest < step if self.gang.leader else None)
        if not needed:
            return
        base_missing = self.gang.broadcast_flag(latest is None if self.gang.leader else None)
        adapters = to_numpy_tree(adapters_on_host(), self.dtype)
        if base_missing or self._base_sha256 is None:
            base = to_numpy_tree(base_on_host(), self.dtype)
            self._base_sha256 = tree_sha256(base) if self.gang.leader else ""
            if base_missing and self.gang.leader:
                # The adapters' layout rides on the base, so that a worker applying them
                # unmerged attaches zero adapters to it and keeps one program shape.
                layout = {
                    LORA_RANK: int(next(iter(adapters.values()))["a"].shape[-1]),
                    LORA_TARGETS: list(adapters),
                    LORA_SCALE: float(scale),
                }
                self._retrying(0, lambda: self._push(0, base, layout))
            del base
        if step == 0:
            return  # version 0 is the base itself: B starts at zero
        metadata = {LORA_BASE_VERSION: 0, LORA_BASE_SHA256: self._base_sha256, LORA_SCALE: float(scale)}
        if self.gang.leader:
            self._retrying(step, lambda: self._push(step, {"lora": adapters}, metadata))

    def _retrying(self, step: int, attempt: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return attempt()
            except (ProtocolTimeoutError, ConnectionError) as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cannot publish version {step} to {self.address}: {error}") from None
                log.warning("publishing version %d failed (%s); retrying", step, error)
                time.sleep(0.5)

    def _needs_push(self, step: int) -> bool:
        assert self.client is not None
        client = self.client
        latest = self._retrying(step, client.latest)
        return latest is None or latest < step

    def _push(self, step: int, tree: Any, metadata: dict[str, Any] | None = None) -> None:
        assert self.client is not None
        try:
            self.client.push(tree, step, {"step": step, **(metadata or {})})
        except StaleVersionError:
            # Pushed already: by a previous life of this process, concurrently, or by this
            # call's first attempt whose reply was lost (`publish` checked `latest` just before).
            return
        log.info("published version %d", step)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
