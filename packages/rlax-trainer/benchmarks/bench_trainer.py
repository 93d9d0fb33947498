"""Trainer throughput for a SmolLM2-135M-shaped model (random weights), against this machine's
matmul peak measured in the same run, and the cost of the aligned (nothing-saveable) mode.

One update = the trainer's own pi_old forward pass + forward/backward + AdamW, so its
model FLOPs are ~8 * N_params per token plus attention (2 * 4 * L * S * d_attn per token,
forward+backward+recompute counted the same way).

Run: `nox -s bench` (or `pytest packages/rlax-trainer/benchmarks -s`). Sizes shrink via
RLAX_BENCH_SEQ / RLAX_BENCH_BATCH for slow machines.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import rlax_model
from rlax_model.roofline import matmul_peak_flops
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, preset

SEQ = int(os.environ.get("RLAX_BENCH_SEQ", "128"))
BATCH = int(os.environ.get("RLAX_BENCH_BATCH", "4"))
RESULTS: dict[str, float] = {}


def make_batch(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, vocab, size=(BATCH, SEQ)).astype(np.int32)
    mask = np.zeros((BATCH, SEQ - 1), np.float32)
    mask[:, SEQ // 4 :] = 1.0
    return {
        "tokens": tokens,
        "valid": np.ones((BATCH, SEQ), bool),
        "mask": mask,
        "worker_logprobs": (-2.0 * mask).astype(np.float32),
        "rewards": rng.integers(0, 2, size=BATCH).astype(np.float32),
    }


def model_flops_per_token(cfg: rlax_model.ModelConfig, n_params: int) -> float:
    attn = 2 * cfg.num_layers * SEQ * cfg.num_heads * cfg.head_dim  # QK^T and PV, per token, forward
    return 8 * n_params + 4 * attn


@pytest.fixture(scope="module")
def setup():
    cfg = rlax_model.ModelConfig.smollm2_135m()
    params = rlax_model.init_params(cfg, jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    peak = matmul_peak_flops()
    RESULTS["peak_flops"] = peak
    return cfg, params, n_params, peak


@pytest.mark.parametrize("remat", ["none", "nothing_saveable"])
def test_trainer_tokens_per_second(benchmark, setup, remat):
    cfg, params, n_params, peak = setup
    learner_cfg = LearnerConfig(
        objective=preset("grpo", kl={"coef": 0.0}),
        group_size=BATCH,
        global_batch=BATCH,
        remat=remat,
        optimizer=OptimizerConfig(lr=1e-6),
    )
    learner = Learner(cfg, learner_cfg, params)
    batch = make_batch(cfg.vocab_size)
    learner.update(batch)  # compile

    def step():
        jax.block_until_ready(learner.update(batch))

    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=0)
    seconds = benchmark.stats.stats.min
    tokens_per_s = BATCH * SEQ / seconds
    mfu = tokens_per_s * model_flops_per_token(cfg, n_params) / peak
    RESULTS[remat] = seconds
    benchmark.extra_info.update(tokens_per_s=tokens_per_s, mfu=mfu, peak_gflops=peak / 1e9)
    print(
        f"\n[rlax-trainer] SmolLM2-135M shape, batch {BATCH} x seq {SEQ}, remat={remat}: "
        f"{tokens_per_s:.0f} train tokens/s; model FLOP/s / matmul peak ({peak / 1e9:.1f} GFLOP/s) = {mfu:.3f}"
    )
    if "none" in RESULTS and "nothing_saveable" in RESULTS:
        ratio = RESULTS["nothing_saveable"] / RESULTS["none"]
        print(f"[rlax-trainer] aligned (nothing_saveable) step time / default step time = {ratio:.2f}")
