from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import pytest

import rlax_model

# --import-mode=importlib does not put test folders on sys.path; the float64 objective
# reference (trainer_objective_reference.py) lives here.
_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def tiny_model() -> rlax_model.ModelConfig:
    return rlax_model.ModelConfig.tiny(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )


def random_batch(seed: int, b: int = 8, s: int = 12, vocab: int = 32) -> dict[str, np.ndarray]:
    """A right-padded batch: 3 prompt tokens, completions of varying length."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab, size=(b, s)).astype(np.int32)
    lengths = rng.integers(2, s - 3 + 1, size=b)
    valid = np.arange(s)[None, :] < (3 + lengths)[:, None]
    tokens = np.where(valid, tokens, 0).astype(np.int32)
    mask = ((np.arange(s - 1)[None, :] >= 2) & (np.arange(s - 1)[None, :] < (2 + lengths)[:, None])).astype(
        np.float32
    )
    return {
        "tokens": tokens,
        "valid": valid,
        "mask": mask,
        "worker_logprobs": (-rng.uniform(1.0, 5.0, size=(b, s - 1)) * mask).astype(np.float32),
        "rewards": rng.integers(0, 2, size=b).astype(np.float32),
    }


@pytest.fixture(scope="session")
def model_config() -> rlax_model.ModelConfig:
    return tiny_model()


@pytest.fixture(scope="session")
def model_params(model_config):
    return rlax_model.init_params(model_config, jax.random.key(0))


@pytest.fixture(scope="session")
def make_batch():
    return random_batch


@pytest.fixture(scope="session")
def minibatch_config():
    """Two optimizer steps per batch (so the clip and the RNG-driven group shuffle act) with TIS.
    Shared by several tests so that the update compiles once per session."""
    from rlax_trainer import LearnerConfig, OptimizerConfig, preset

    return LearnerConfig(
        objective=preset("grpo", importance={"tis_cap": 1.5}),
        group_size=4,
        global_batch=8,
        minibatches=2,
        optimizer=OptimizerConfig(
            lr=0.05, max_grad_norm=None, warmup_steps=1, schedule="cosine", decay_steps=8
        ),
    )
