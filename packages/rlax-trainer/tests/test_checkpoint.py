from __future__ import annotations

import logging
import shutil

import jax
import numpy as np
import pytest

from rlax_trainer import Learner, RolloutBuffer
from rlax_trainer.checkpoint import CheckpointManager, state_fingerprint


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
    # Step 2 reads fine but its bytes changed on disk: the fingerprint catches it.
    _corrupt(tmp_path / "c" / "2")
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
