"""The dtype policy: the dtypes a model actually runs in on a given backend.

One rule, applied wherever engine or trainer parameters are built (the inference worker,
the trainer process, the learner), so that both sides of a run compute with the same
numerics:

- On accelerators (TPU, GPU) the configured `param_dtype` / `compute_dtype` are used as they are.
- On the CPU, bfloat16 (parameters or compute) becomes float32, and one log line says so:
  XLA:CPU has no fast bfloat16 matmuls (it converts around every dot), so bfloat16
  generation measured 3x slower than float32 on SmolLM2-135M, and bfloat16 training gains
  nothing. Weights that arrive in bfloat16 (a checkpoint, or a trainer publishing bfloat16)
  are held in float32 exactly (every bfloat16 value is a float32 value), so the model
  computes the same function at full precision.
- Opt out with `allow_bf16_on_cpu=True` or the environment variable `RLAX_BF16_ON_CPU=1`
  (read by every process of a run, so its trainer and workers follow the same rule).
"""

from __future__ import annotations

import logging
import os

from rlax_model.config import DTypeName, ModelConfig

__all__ = ["BF16_ON_CPU_ENV", "dtype_policy", "resolve_dtypes"]

BF16_ON_CPU_ENV = "RLAX_BF16_ON_CPU"
log = logging.getLogger("rlax.model")
_TRUE = ("1", "true", "yes", "on")


def _platform(platform: str | None) -> str:
    if platform is not None:
        return platform.lower()
    import jax

    return jax.default_backend()


def _allowed(allow_bf16_on_cpu: bool | None) -> bool:
    if allow_bf16_on_cpu is not None:
        return allow_bf16_on_cpu
    return os.environ.get(BF16_ON_CPU_ENV, "").strip().lower() in _TRUE


def resolve_dtypes(
    param_dtype: DTypeName,
    compute_dtype: DTypeName | None = None,
    platform: str | None = None,
    *,
    allow_bf16_on_cpu: bool | None = None,
) -> tuple[DTypeName, DTypeName]:
    """(param_dtype, compute_dtype) to run with on `platform` (default: JAX's default backend).

    compute_dtype None means the same as param_dtype. allow_bf16_on_cpu None reads
    `RLAX_BF16_ON_CPU` from the environment.
    """
    compute = compute_dtype or param_dtype
    if (
        _platform(platform) != "cpu"
        or "bfloat16" not in (param_dtype, compute)
        or _allowed(allow_bf16_on_cpu)
    ):
        return param_dtype, compute
    return "float32", "float32"


def dtype_policy(
    config: ModelConfig, platform: str | None = None, *, allow_bf16_on_cpu: bool | None = None
) -> ModelConfig:
    """The `config` a model runs with on `platform`; see the module docstring for the rule.

    Returns `config` itself when nothing changes; otherwise a float32 copy, after one
    warning on the "rlax.model" logger naming the requested dtypes, the reason and the opt-out.
    """
    param, compute = resolve_dtypes(
        config.param_dtype, config.compute_dtype, platform, allow_bf16_on_cpu=allow_bf16_on_cpu
    )
    if (param, compute) == (config.param_dtype, config.compute_dtype):
        return config
    log.warning(
        "dtype policy: param_dtype=%s compute_dtype=%s requested on the CPU backend; computing in "
        "float32 instead (XLA:CPU has no fast bfloat16 matmuls: bfloat16 generates ~3x slower than "
        "float32 there); set %s=1 to force bfloat16",
        config.param_dtype,
        config.compute_dtype,
        BF16_ON_CPU_ENV,
    )
    return config.replace(param_dtype=param, compute_dtype=compute)
