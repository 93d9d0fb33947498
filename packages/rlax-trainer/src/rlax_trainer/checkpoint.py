"""Asynchronous orbax checkpoints of the train state, with integrity checks on restore.

A checkpoint holds the whole `TrainState` (float32 params, optimizer state, step, RNG)
plus JSON metadata: weight version, buffer counters, the learner config, and a
fingerprint of every array computed on device when saving. Orbax commits a step
atomically (a partial write stays a temporary folder and is never listed); a committed
step that fails to load or whose fingerprint differs is reported in the log and the
next older step is restored instead.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import orbax.checkpoint as ocp

from rlax_trainer.buffer import BufferStats
from rlax_trainer.learner import TrainState

__all__ = ["CheckpointManager", "Restored", "state_fingerprint"]

log = logging.getLogger(__name__)


class Restored(msgspec.Struct, frozen=True):
    """What `CheckpointManager.restore` returns besides the state."""

    step: int
    version: int
    buffer: BufferStats | None
    extra: dict[str, Any]


def _as_u32(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    bits = x.dtype.itemsize * 8
    if bits == 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if bits == 16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if bits == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if bits == 64:
        pair = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return pair[..., 0] ^ (pair[..., 1] * jnp.uint32(0x9E3779B1))
    raise TypeError(f"cannot fingerprint dtype {x.dtype}")


@jax.jit
def _fingerprint(tree: Any) -> jax.Array:
    # Position-weighted sum of the raw bits (mod 2^32) per leaf, mixed across leaves:
    # any changed, swapped or truncated value changes it; computed where the arrays live.
    total = jnp.uint32(0)
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        u = _as_u32(jnp.asarray(leaf)).ravel()
        pos = jnp.arange(u.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(2 * i + 1)
        h = jnp.sum(u * pos, dtype=jnp.uint32) ^ jnp.uint32(u.size)
        total = total * jnp.uint32(16777619) + h
    return total


def state_fingerprint(state: Any) -> int:
    """A 32-bit fingerprint of every array's bits (identical on every process)."""
    return int(np.asarray(jax.device_get(_fingerprint(state))))


class CheckpointManager:
    """Saves `TrainState`s under `directory/<step>/`, keeping the newest `max_to_keep`.

    Saving is asynchronous (returns once the arrays are copied off the accelerator);
    `wait()` blocks until the last save is on disk. Multi-host: every process calls
    save/restore with its shards; orbax coordinates the processes.
    """

    def __init__(
        self, directory: str | pathlib.Path, *, max_to_keep: int = 3, asynchronous: bool = True
    ) -> None:
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=asynchronous, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(
        self,
        state: TrainState,
        *,
        version: int,
        buffer: BufferStats | None = None,
        extra: dict[str, Any] | None = None,
    ) -> int:
        """Start saving `state` as step `state.step`; returns that step."""
        step = int(jax.device_get(state.step))
        meta = {
            "step": step,
            "version": int(version),
            "buffer": None if buffer is None else msgspec.to_builtins(buffer),
            "extra": extra or {},
            "fingerprint": state_fingerprint(state),
        }
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        return step

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, like: TrainState, *, step: int | None = None) -> tuple[TrainState, Restored] | None:
        """Restore the newest loadable step (or exactly `step`) with the shapes, dtypes and
        shardings of `like`; None when there is no checkpoint at all. A damaged newest step
        is logged and skipped; if every step is damaged a RuntimeError lists why."""
        self.wait()
        self._manager.reload()
        candidates = self.steps()[::-1] if step is None else [step]
        if not candidates:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        failures = []
        for s in candidates:
            try:
                out = self._manager.restore(
                    s,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                    ),
                )
                state, meta = out["state"], out["meta"]
                state = TrainState(*state) if not isinstance(state, TrainState) else state
                got = state_fingerprint(state)
                if got != meta["fingerprint"]:
                    raise ValueError(
                        f"fingerprint {got:#010x} != saved {meta['fingerprint']:#010x} (data changed on disk)"
                    )
            except Exception as e:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                failures.append(f"step {s}: {reason}")
                log.warning(
                    "checkpoint step %d in %s is damaged (%s); trying the previous one",
                    s,
                    self.directory,
                    reason,
                )
                continue
            if failures:
                log.warning(
                    "restored checkpoint step %d from %s after skipping damaged %s",
                    s,
                    self.directory,
                    failures,
                )
            else:
                log.info("restored checkpoint step %d from %s", s, self.directory)
            buffer = None if meta["buffer"] is None else msgspec.convert(meta["buffer"], BufferStats)
            return state, Restored(step=s, version=meta["version"], buffer=buffer, extra=meta["extra"])
        raise RuntimeError(f"no loadable checkpoint in {self.directory}: {'; '.join(failures)}")

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
