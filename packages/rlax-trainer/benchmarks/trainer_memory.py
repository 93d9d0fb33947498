"""Peak memory of one Learner update for SmolLM2-135M shapes (random weights of the GGUF's shape).

Run one configuration per process (peak RSS is per process), e.g.

    JAX_PLATFORMS=cpu python packages/rlax-trainer/benchmarks/trainer_memory.py \
        --seq 512 --real 128 --dtype float32 --remat full

Before issue 13 the trainer ran as `--no-trim --chunk none` (dense logits at the padded
length); add `--analysis` to compile only.

Prints XLA's compiled memory analysis of the update (argument / output / temp bytes) and
the process's peak RSS after one update, as one JSON line. `--seq` is the padded length
the batch arrives with, `--real` the longest real sequence in it (prompt + completion).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
import numpy as np

import rlax_model
from rlax_core.gguf_file import GGUFFile, find_smollm2_gguf
from rlax_model.gguf_import import gguf_config
from rlax_trainer import Learner, LearnerConfig, OptimizerConfig, preset


def make_batch(b: int, s: int, real: int, prompt: int, vocab: int) -> dict[str, np.ndarray]:
    """b rows padded to s, each `real` tokens long of which the first `prompt` are the prompt."""
    rng = np.random.default_rng(0)
    tokens = np.zeros((b, s), np.int32)
    tokens[:, :real] = rng.integers(3, vocab, size=(b, real))
    valid = np.zeros((b, s), bool)
    valid[:, :real] = True
    mask = np.zeros((b, s - 1), np.float32)
    mask[:, prompt - 1 : real - 1] = 1.0
    return {
        "tokens": tokens,
        "valid": valid,
        "mask": mask,
        "worker_logprobs": (-2.0 * mask).astype(np.float32),
        "rewards": rng.integers(0, 2, size=b).astype(np.float32),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--real", type=int, default=128)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk", default="256", help="logprob_chunk_size in tokens, or 'none' (dense)")
    p.add_argument("--remat", default="none")
    p.add_argument("--preset", default="dapo")
    p.add_argument("--no-trim", action="store_true", help="run at --seq, not the bucketed real length")
    p.add_argument("--analysis", action="store_true", help="compile only; print XLA's memory analysis")
    a = p.parse_args()
    mc = gguf_config(GGUFFile(find_smollm2_gguf()), param_dtype=a.dtype)
    params = rlax_model.init_params(mc, jax.random.key(0))
    cfg = LearnerConfig(
        objective=preset(a.preset),
        group_size=a.batch,
        global_batch=a.batch,
        param_dtype=a.dtype,
        remat=a.remat,
        logprob_chunk_size=None if a.chunk == "none" else int(a.chunk),
        trim_padding=not a.no_trim,
        optimizer=OptimizerConfig(lr=1e-6),
    )
    learner = Learner(mc, cfg, params)
    del params
    batch = make_batch(a.batch, a.seq, a.real, a.prompt, mc.vocab_size)
    if not a.no_trim:
        from rlax_trainer.padding import trim_to_bucket

        batch = trim_to_bucket(batch)  # what update() does; here so that --analysis sees it too
    if a.analysis:
        mem = learner.compiled_memory(batch)
        print(json.dumps({"args": vars(a), "shape": list(batch["tokens"].shape), **mem}))
        return
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.monotonic()
    metrics = learner.update(batch)
    out = {
        "args": vars(a),
        "shape": list(batch["tokens"].shape),
        "rss_before_update_mb": rss_before,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "update_s": time.monotonic() - t0,
        "loss": metrics.get("loss"),
    }
    out.update({k: v for k, v in metrics.items() if "peak" in k})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
