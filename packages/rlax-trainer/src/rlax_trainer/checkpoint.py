"""Asynchronous orbax checkpoints of the train state, with integrity checks on restore.

A checkpoint holds the whole `TrainState` (float32 params, optimizer state, step, RNG)
plus JSON metadata: weight version, buffer counters, the learner config, and a
fingerprint of every array computed on device when saving. Orbax commits a step
atomically (a partial write stays a temporary folder and is never listed).

Restore falls back to the next older step only when the newest is *damaged*: its
fingerprint differs (a checksum error) or its files cannot be decoded (a format error:
truncated or missing array data, unreadable JSON, a missing item). The damage is logged
and raised as `CheckpointDamagedError` naming the step. Any other failure (an I/O error
such as EIO or EACCES, out of memory on host or device, arrays that do not fit the
template) stops the restore with that error: an older step would silently lose work
that is still intact on disk.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import orbax.checkpoint as ocp

from rlax_trainer.buffer import BufferStats
from rlax_trainer.learner import TrainState

__all__ = ["CheckpointDamagedError", "CheckpointManager", "Restored", "state_fingerprint"]

log = logging.getLogger(__name__)


class Restored(msgspec.Struct, frozen=True):
    """What `CheckpointManager.restore` returns besides the state."""

    step: int
    version: int
    buffer: BufferStats | None
    extra: dict[str, Any]


class CheckpointDamagedError(RuntimeError):
    """A committed step whose data fails its checksum or cannot be decoded."""

    def __init__(self, step: int, directory: pathlib.Path, reason: str) -> None:
        super().__init__(f"checkpoint step {step} in {directory} is damaged: {reason}")
        self.step = step
        self.reason = reason


# TensorStore reports undecodable stored data with these status codes...
_DAMAGE_STATUS = re.compile(r"^(DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|NOT_FOUND|INVALID_ARGUMENT): ")
# ...and an operating-system error with its errno; only a missing file (errno 2) is damage.
_OS_ERROR = re.compile(
    r"\[OS error(?: (\d+))?:|Input/output error|Permission denied|No space left|Cannot allocate"
)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in out:
        out.append(link)
        link = link.__cause__ or link.__context__
    return out


def _damage_reason(exc: BaseException) -> str | None:
    """Why `exc` (raised by orbax while restoring) shows the step's own data is damaged;
    None when it is anything else: I/O, memory, or a template that does not match."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, MemoryError | jax.errors.JaxRuntimeError):
            return None
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            return None
        os_error = _OS_ERROR.search(str(e))
        if os_error and os_error.group(1) != "2":
            return None
    for e in chain:
        first = str(e).splitlines()[0] if str(e) else ""
        if isinstance(e, json.JSONDecodeError):
            return f"unreadable metadata JSON ({first})"
        if isinstance(e, FileNotFoundError):
            return f"missing file ({first})"
        if isinstance(e, KeyError) and "was not found in the checkpoint" in first:
            return f"missing item ({first})"
        if isinstance(e, ValueError) and (
            _DAMAGE_STATUS.match(first) or first.startswith("pytree structure error")
        ):
            return f"undecodable array data ({first[:300]})"
    return None


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
        mixed: jax.Array = pair[..., 0] ^ (pair[..., 1] * jnp.uint32(0x9E3779B1))
        return mixed
    raise TypeError(f"cannot fingerprint dtype {x.dtype}")


# Elements hashed per loop iteration (1 MiB of float32).
_HASH_BLOCK = 1 << 18


def _block_hash(flat: jax.Array, start: jax.Array | int, size: int, salt: jax.Array) -> jax.Array:
    """sum(bits[i] * (i * 2654435761 + salt)) over flat[start : start + size], mod 2^32."""
    u = _as_u32(jax.lax.dynamic_slice_in_dim(flat, start, size))
    i = jnp.arange(size, dtype=jnp.uint32) + jnp.asarray(start).astype(jnp.uint32)
    return jnp.sum(u * (i * jnp.uint32(2654435761) + salt), dtype=jnp.uint32)


@jax.jit
def _leaf_hash(leaf: jax.Array, index: jax.Array) -> jax.Array:
    # Position-weighted sum of the raw bits (mod 2^32): any changed, swapped or truncated
    # value changes it; computed where the array lives. In blocks of _HASH_BLOCK elements:
    # over a whole leaf XLA's CPU backend materialises the weighted bits before summing
    # them (a copy of the leaf: +108 MiB for SmolLM2's embedding, the checkpoint's peak).
    # The sum is mod 2^32, so the blocks' order does not change the value.
    x = jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else jnp.asarray(leaf)
    flat = x.reshape(-1)  # 64-bit values become one u32 each in _as_u32, block by block
    n = flat.size
    salt = (2 * index + 1).astype(jnp.uint32)
    full = n // _HASH_BLOCK
    total = jnp.uint32(0)
    if full:
        total = jax.lax.fori_loop(
            0, full, lambda b, acc: acc + _block_hash(flat, b * _HASH_BLOCK, _HASH_BLOCK, salt), total
        )
    if n % _HASH_BLOCK:
        total = total + _block_hash(flat, full * _HASH_BLOCK, n % _HASH_BLOCK, salt)
    salted: jax.Array = total ^ jnp.uint32(n)
    return salted


def state_fingerprint(state: Any) -> int:
    """A 32-bit fingerprint of every array's bits (identical on every process).

    One program per leaf shape, mixed on the host: hashing the whole tree in one program let
    XLA keep every leaf's temporaries alive together (+500 MB on SmolLM2-135M's train state,
    the trainer's peak); leaf by leaf, in blocks (`_leaf_hash`), they are one block's.
    """
    total = 0
    for i, leaf in enumerate(jax.tree.leaves(state)):
        h = int(np.asarray(jax.device_get(_leaf_hash(leaf, jnp.uint32(i)))))
        total = (total * 16777619 + h) % 2**32
    return total


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
        # Uncompressed. With orbax's default zstd the OCDBT store held every array's
        # compressed bytes until the step committed: a second copy of the state on the host
        # (+1.36 GiB at the save's peak for SmolLM2-135M's 1.5 GiB; checkpoint steps peaked
        # as high as the update), to save ~12% of the disk (float32 weights and Adam moments
        # hardly compress). Uncompressed, TensorStore writes from the arrays' own buffers
        # (on a CPU, numpy views of the device buffers): +14 MiB at the peak. Steps written
        # compressed still restore: the codec is in each array's stored metadata.
        handlers = {
            "state": ocp.PyTreeCheckpointHandler(use_compression=False),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

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
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        return step

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, like: TrainState, *, step: int | None = None) -> tuple[TrainState, Restored] | None:
        """Restore the newest loadable step (or exactly `step`) with the shapes, dtypes and
        shardings of `like`; None when there is no checkpoint at all. A damaged step
        (`CheckpointDamagedError`: checksum or format) is logged and the previous one tried;
        if every step is damaged a RuntimeError lists why. Any other error propagates."""
        self.wait()
        self._manager.reload()
        candidates = self.steps()[::-1] if step is None else [step]
        if not candidates:
            return None
        failures = []
        for s in candidates:
            try:
                state, meta = self._restore_step(s, like)
            except CheckpointDamagedError as e:
                failures.append(f"step {s}: {e.reason}")
                log.warning("%s; trying the previous one", e)
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

    def _restore_step(self, step: int, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """Load one step and check it; raises CheckpointDamagedError for checksum/format errors."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            reason = _damage_reason(e)
            if reason is None:
                raise
            raise CheckpointDamagedError(step, self.directory, reason) from e
        state, meta = out["state"], out["meta"]
        state = TrainState(*state) if not isinstance(state, TrainState) else state
        missing = {"version", "buffer", "extra", "fingerprint"} - set(meta if isinstance(meta, dict) else ())
        if missing:
            raise CheckpointDamagedError(step, self.directory, f"metadata lacks {sorted(missing)}")
        got = state_fingerprint(state)
        if got != meta["fingerprint"]:
            raise CheckpointDamagedError(
                step,
                self.directory,
                f"fingerprint {got:#010x} != saved {meta['fingerprint']:#010x} (data changed on disk)",
            )
        return state, meta

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
