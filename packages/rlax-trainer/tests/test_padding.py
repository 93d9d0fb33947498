"""The update runs at the batch's real length rounded up to a bucket, not the padded length."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, preset
from rlax_trainer.padding import bucketed_length, real_length, trim_to_bucket


def test_bucketed_length_steps():
    # Enumerated by hand: 16 floor, then 4 evenly spaced buckets per doubling.
    want = {1: 16, 16: 16, 17: 20, 31: 32, 32: 32, 33: 40, 40: 40, 41: 48, 64: 64, 65: 80, 100: 112, 128: 128}
    want.update({129: 160, 200: 224, 257: 320, 1000: 1024, 1025: 1280})
    assert {n: bucketed_length(n) for n in want} == want
    with pytest.raises(ValueError):
        bucketed_length(0)


def pad(batch: dict[str, np.ndarray], s: int) -> dict[str, np.ndarray]:
    """Right-pad every per-position array of `batch` to `s` tokens."""
    s0 = batch["tokens"].shape[1]
    out = dict(batch)
    for k in ("tokens", "valid", "mask", "worker_logprobs"):
        v = batch[k]
        width = s - s0
        out[k] = np.pad(v, ((0, 0), (0, width)))
    return out


def test_trim_keeps_every_used_column(make_batch):
    batch = pad(make_batch(0, s=12), 100)  # real length <= 12 -> bucket 16
    n = real_length(batch["valid"], batch["mask"])
    assert n == np.flatnonzero(batch["valid"].any(0))[-1] + 1
    out = trim_to_bucket(batch)
    assert out["tokens"].shape == (8, 16) and out["mask"].shape == (8, 15)
    assert out["rewards"] is batch["rewards"]
    for k in ("tokens", "valid", "mask", "worker_logprobs"):
        np.testing.assert_array_equal(out[k], batch[k][:, : out[k].shape[1]])
        assert not batch[k][:, out[k].shape[1] :].any()
    # A mask entry past the last valid token still counts (it scores token 41): kept, not cut.
    batch["mask"][0, 40] = 1.0
    assert trim_to_bucket(batch)["tokens"].shape == (8, 48)


def test_update_runs_at_the_bucket_and_matches_the_padded_update(model_config, model_params, make_batch):
    cfg = LearnerConfig(
        objective=preset("grpo", importance={"tis_cap": None}),
        group_size=4,
        global_batch=8,
        optimizer=OptimizerConfig(lr=1e-2),
        packing=False,  # the padded layout's length buckets (test_packing covers packed batches)
    )
    batch = pad(make_batch(3, s=12), 64)  # as if collated to max_seq_len=64
    trimmed = Learner(model_config, cfg, model_params)
    m = trimmed.update(batch)
    assert trimmed.last_seq_len == 16 and m["trainer_seq_len"] == 16.0
    full = Learner(model_config, LearnerConfig(**{**_fields(cfg), "trim_padding": False}), model_params)
    m_full = full.update(batch)
    assert full.last_seq_len == 64
    a, b = (
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(lr.host_params())]) for lr in (trimmed, full)
    )
    # float32 rounding only: the dense vocabulary projection reduces over the padded length
    # in another order (2 of 20,640 weights differed by 2e-6 after the Adam step at lr 1e-2).
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert abs(m["loss"] - m_full["loss"]) < 1e-6
    assert abs(m["grad_norm"] - m_full["grad_norm"]) < 1e-5


def _fields(cfg: LearnerConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__struct_fields__}


def test_update_reports_peak_rss(model_config, model_params, make_batch):
    cfg = LearnerConfig(objective=preset("grpo", importance={"tis_cap": None}), group_size=4, global_batch=8)
    m = Learner(model_config, cfg, model_params).update(make_batch(1))
    # Independent source: the kernel's high-water mark of this process, read after the update.
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    hwm_mb = int(status["VmHWM"].split()[0]) / 1024
    assert 0.5 * hwm_mb <= m["trainer_peak_rss_mb"] <= hwm_mb + 1.0
