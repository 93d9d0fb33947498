from __future__ import annotations

import errno
import logging
import pathlib
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_trainer import Learner, RolloutBuffer
from rlax_trainer.checkpoint import CheckpointManager, state_fingerprint
from rlax_trainer.learner import TrainState
from rlax_trainer.memory import release_free_memory


def leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def test_resume_is_bit_identical(tmp_path, model_config, model_params, make_batch, minibatch_config):
    n, m = 2, 2
    batches = [make_batch(10 + i) for i in range(n + m)]
    buffer = RolloutBuffer(group_size=4, max_staleness=2)
    buffer.expired_groups = 3

    straight = Learner(model_config, minibatch_config, model_params, seed=7)
    for b in batches:
        straight.update(b)

    first = Learner(model_config, minibatch_config, model_params, seed=7)
    with CheckpointManager(tmp_path / "ckpt", max_to_keep=2) as ckpt:
        for i, b in enumerate(batches[:n]):
            first.update(b)
            ckpt.save(first.state, version=first.step, buffer=buffer.stats(), extra={"batch": i})
            # The next update donates the state's buffers while the save may still be writing.
        first.update(make_batch(99))
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
    del first

    resumed = Learner(
        model_config, minibatch_config, model_params, seed=123
    )  # a different seed: the RNG comes from the checkpoint
    with CheckpointManager(tmp_path / "ckpt") as ckpt:
        state, info = ckpt.restore(resumed.state)
    assert info.step == n and info.version == n and info.extra == {"batch": n - 1}
    assert info.buffer.expired_groups == 3 and info.buffer.max_staleness == 2
    resumed.load_state(state)
    for b in batches[n:]:
        resumed.update(b)
    for a, b in zip(leaves(straight.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)


def _corrupt(step_dir) -> None:
    files = sorted(
        (p for p in step_dir.rglob("*") if p.is_file() and "state" in p.parts), key=lambda p: p.stat().st_size
    )
    target = files[-1]
    data = bytearray(target.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))


def test_damaged_newest_checkpoints_fall_back(
    tmp_path, model_config, model_params, make_batch, caplog, minibatch_config
):
    learner = Learner(model_config, minibatch_config, model_params)
    prints = {}
    with CheckpointManager(tmp_path / "c", max_to_keep=3) as ckpt:
        for i in range(3):
            learner.update(make_batch(i))
            prints[learner.step] = state_fingerprint(learner.state)
            ckpt.save(learner.state, version=learner.step)
        ckpt.wait()
    # Step 3 lost its array data (a partial write): orbax cannot read it.
    for sub in (tmp_path / "c" / "3" / "state").iterdir():
        if sub.is_dir() and sub.name.startswith("ocdbt"):
            shutil.rmtree(sub)
    # Step 2 decodes but its arrays are not the ones it was saved with (here: step 1's):
    # the fingerprint catches it. (Flipped bytes usually fail zstd decoding instead.)
    shutil.rmtree(tmp_path / "c" / "2" / "state")
    shutil.copytree(tmp_path / "c" / "1" / "state", tmp_path / "c" / "2" / "state")
    # A crash mid-save leaves orbax's temporary folder, which is never a candidate.
    (tmp_path / "c" / "4.orbax-checkpoint-tmp-1").mkdir()
    with (
        CheckpointManager(tmp_path / "c") as ckpt,
        caplog.at_level(logging.WARNING, logger="rlax_trainer.checkpoint"),
    ):
        state, info = ckpt.restore(learner.state)
    assert info.step == 1 and state_fingerprint(state) == prints[1]
    assert (
        "checkpoint step 3" in caplog.text
        and "checkpoint step 2" in caplog.text
        and "fingerprint" in caplog.text
    )
    assert "restored checkpoint step 1" in caplog.text

    _corrupt(tmp_path / "c" / "1")
    with (
        CheckpointManager(tmp_path / "c") as ckpt,
        pytest.raises(RuntimeError, match="no loadable checkpoint.*step 3.*step 2.*step 1"),
    ):
        ckpt.restore(learner.state)
    with CheckpointManager(tmp_path / "empty") as ckpt:
        assert ckpt.restore(learner.state) is None


def small_state(step: int) -> TrainState:
    return TrainState(
        {"w": jnp.arange(64, dtype=jnp.float32) * step},
        {"m": jnp.ones(64)},
        jnp.array(step),
        jnp.zeros(2, jnp.uint32),
    )


def _tensorstore_read_error(status: str) -> Exception:
    """How orbax surfaces a TensorStore read failure: a generic Exception over a ValueError."""
    try:
        try:
            raise ValueError(
                f'{status}: Error reading "params.w/0" in OCDBT database at local file "/c/2/state/"'
            )
        except ValueError as inner:
            raise Exception("Encountered error while reading array index: (slice(0, 64, 1),).") from inner
    except Exception as outer:
        return outer


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, "Input/output error"),
        PermissionError(errno.EACCES, "Permission denied"),
        _tensorstore_read_error("UNKNOWN: [OS error 5: Input/output error]"),
        _tensorstore_read_error("FAILED_PRECONDITION: [OS error 13: Permission denied]"),
        MemoryError(),
        jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 64.00GiB"),
    ],
    ids=["eio", "eacces", "tensorstore-eio", "tensorstore-eacces", "host-oom", "device-oom"],
)
def test_io_error_or_out_of_memory_stops_the_restore(tmp_path, error):
    """Only a checksum/format error of a step makes restore fall back; an I/O error or OOM
    on the newest step (whose data may be intact) is raised as it is."""
    with CheckpointManager(tmp_path / "c", asynchronous=False) as ckpt:
        for step in (1, 2):
            ckpt.save(small_state(step), version=step)
    with CheckpointManager(tmp_path / "c") as ckpt:
        original = ckpt._manager.restore

        def failing_restore(step, *args, **kwargs):
            if step == 2:
                raise error
            return original(step, *args, **kwargs)

        ckpt._manager.restore = failing_restore
        with pytest.raises(type(error)) as caught:
            ckpt.restore(small_state(0))
        assert caught.value is error


def test_unreadable_metadata_is_damage_named_by_step(tmp_path, caplog):
    with CheckpointManager(tmp_path / "c", asynchronous=False) as ckpt:
        for step in (1, 2):
            ckpt.save(small_state(step), version=step)
    for f in (tmp_path / "c" / "2" / "meta").rglob("metadata"):
        f.write_text("{not json")
    with (
        CheckpointManager(tmp_path / "c") as ckpt,
        caplog.at_level(logging.WARNING, logger="rlax_trainer.checkpoint"),
    ):
        state, info = ckpt.restore(small_state(0))
        assert info.step == 1 and state_fingerprint(state) == state_fingerprint(small_state(1))
        with pytest.raises(RuntimeError, match=r"no loadable checkpoint.*step 2: unreadable metadata JSON"):
            ckpt.restore(small_state(0), step=2)
    assert "checkpoint step 2 in" in caplog.text and "is damaged: unreadable metadata JSON" in caplog.text


def test_fingerprint_is_the_documented_hash_of_the_raw_bits() -> None:
    # Checkpoints on disk carry this value: it must not change with how it is computed.
    # Reference in numpy from the definition: per leaf, sum(bits[i] * (i * 2654435761 + 2k + 1))
    # ^ size (mod 2^32), mixed as total = total * 16777619 + h (mod 2^32).
    import ml_dtypes

    rng = np.random.default_rng(3)
    tree = {
        "a": rng.normal(size=(300, 7)).astype(np.float32),
        "b": rng.normal(size=(5,)).astype(ml_dtypes.bfloat16),
        "c": [rng.integers(-9, 9, size=(4, 4)).astype(np.int32)],
    }
    total = 0
    for k, leaf in enumerate(jax.tree.leaves(tree)):
        bits = leaf.view(np.uint16 if leaf.dtype.itemsize == 2 else np.uint32).astype(np.uint64).ravel()
        pos = (np.arange(bits.size, dtype=np.uint64) * 2654435761 + 2 * k + 1) % 2**32
        h = int((bits * pos % 2**32).sum() % 2**32) ^ bits.size
        total = (total * 16777619 + h) % 2**32
    assert state_fingerprint(tree) == total


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_save_holds_no_second_copy_of_the_state_on_the_host(tmp_path) -> None:
    """Issue 28: with orbax's default zstd the OCDBT store held every array's compressed
    bytes until the step committed (+90% of the state at the save's peak), and the
    fingerprint materialised a copy of the largest leaf (+100% here); together they were
    the trainer's peak on SmolLM2-135M. Random values: no compressor could shrink them."""
    rng = np.random.default_rng(0)
    state = TrainState(
        {"w": jnp.asarray(rng.normal(size=(8192, 4096)).astype(np.float32))},  # 128 MiB
        {"m": jnp.asarray(rng.normal(size=(4096, 4096)).astype(np.float32))},  # 64 MiB
        jnp.array(3),
        jnp.zeros(2, jnp.uint32),
    )
    state_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.002)

    with CheckpointManager(tmp_path / "c") as ckpt:
        ckpt.save(small_state(1), version=1)  # orbax's and TensorStore's one-time set-up
        ckpt.wait()
        release_free_memory()
        before = peak[0] = _rss_mb()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ckpt.save(state, version=3)
        ckpt.wait()
        done.set()
        sampler.join()
        grew = peak[0] - before
        restored, info = ckpt.restore(state)
    assert grew < 0.3 * state_mb, f"the save grew the RSS by {grew:.0f} MiB for a {state_mb:.0f} MiB state"
    assert info.step == 3 and state_fingerprint(restored) == state_fingerprint(state)


def test_steps_written_compressed_still_restore(tmp_path) -> None:
    """Checkpoints written before saves went uncompressed (orbax's default zstd) load."""
    import orbax.checkpoint as ocp

    state = small_state(2)._replace(params={"w": jnp.arange(2**19, dtype=jnp.float32) % 7})  # 2 MiB
    meta = {
        "step": 2,
        "version": 2,
        "buffer": None,
        "extra": {"k": 1},
        "fingerprint": state_fingerprint(state),
    }
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "c", options=options) as old:
        old.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    stored = sum(p.stat().st_size for p in (tmp_path / "c" / "2" / "state").rglob("*") if p.is_file())
    assert stored < 2**20, f"{stored} bytes: the old format's zstd did not compress the 2 MiB array"
    with CheckpointManager(tmp_path / "c") as ckpt:
        restored, info = ckpt.restore(small_state(0)._replace(params=state.params))
    assert info.step == 2 and info.extra == {"k": 1}
    for a, b in zip(leaves(restored), leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
