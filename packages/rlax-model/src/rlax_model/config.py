"""Typed model configuration: architecture hyper-parameters, RoPE scaling and dtype policy."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

Architecture = Literal["llama", "mistral", "qwen2", "qwen3"]
ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
DTypeName = Literal["float32", "bfloat16"]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ConfigError(ValueError):
    """A configuration field has a bad value; the message names the field and the value."""


def _fail(owner: str, field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{owner}.{field}={value!r}: {why}")


def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(owner, name, value, "must be a positive int")


def _check_positive_float(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _fail(owner, name, value, "must be a positive number")


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation: every rotary frequency is divided by `factor`."""

    factor: float

    def __post_init__(self) -> None:
        _check_positive_float("LinearRopeScaling", "factor", self.factor)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency-dependent RoPE scaling (long wavelengths scaled by `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _check_positive_float("Llama3RopeScaling", "factor", self.factor)
        _check_positive_float("Llama3RopeScaling", "low_freq_factor", self.low_freq_factor)
        _check_positive_float("Llama3RopeScaling", "high_freq_factor", self.high_freq_factor)
        _check_positive_int(
            "Llama3RopeScaling", "original_max_position_embeddings", self.original_max_position_embeddings
        )
        if self.high_freq_factor <= self.low_freq_factor:
            raise _fail(
                "Llama3RopeScaling",
                "high_freq_factor",
                self.high_freq_factor,
                f"must be greater than low_freq_factor={self.low_freq_factor!r}",
            )


RopeScaling = LinearRopeScaling | Llama3RopeScaling


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3).

    Hashable, so it can be a static argument of `jax.jit`.

    sliding_window: when set, a query sees only the last `sliding_window` tokens (itself
    included), as in Mistral; the default attention applies it and a plug-in must too.

    Dtype policy: parameters are stored in `param_dtype`, matmuls run in `compute_dtype`
    (accumulating in float32), RMSNorm statistics, softmax, logits and logprobs are float32.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    param_dtype: DTypeName = "float32"
    compute_dtype: DTypeName = "float32"
    architecture: Architecture = "llama"

    def __post_init__(self) -> None:
        own = "ModelConfig"
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _check_positive_int(own, name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise _fail(own, "num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise _fail(own, "head_dim", self.head_dim, "must be even for rotary embeddings")
        if self.sliding_window is not None:
            _check_positive_int(own, "sliding_window", self.sliding_window)
        _check_positive_float(own, "rope_theta", self.rope_theta)
        _check_positive_float(own, "rms_norm_eps", self.rms_norm_eps)
        if self.rope_scaling is not None and not isinstance(
            self.rope_scaling, (LinearRopeScaling, Llama3RopeScaling)
        ):
            raise _fail(
                own, "rope_scaling", self.rope_scaling, "must be None, LinearRopeScaling or Llama3RopeScaling"
            )
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(own, name, getattr(self, name), "must be a bool")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise _fail(own, name, getattr(self, name), f"must be one of {sorted(_DTYPES)}")
        if self.architecture not in ARCHITECTURES:
            raise _fail(own, "architecture", self.architecture, f"must be one of {list(ARCHITECTURES)}")
        if self.bos_token_id is not None:
            self._check_token_id("bos_token_id", self.bos_token_id)
        if isinstance(self.eos_token_id, list):
            # Lists are unhashable; keep the config usable as a jit static argument.
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.eos_token_id is not None:
            ids = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
            if not ids:
                raise _fail(own, "eos_token_id", self.eos_token_id, "must not be empty")
            for token in ids:
                self._check_token_id("eos_token_id", token)

    def _check_token_id(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
            raise _fail("ModelConfig", name, value, f"must be a token id in [0, {self.vocab_size})")

    @property
    def param_jnp_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self) -> Any:
        return _DTYPES[self.compute_dtype]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids (possibly empty)."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Number of scalar parameters."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        per_layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * i
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * d
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A small random-init-friendly config for tests (2 layers, GQA 4/2 heads)."""
        base: dict[str, Any] = dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def smollm2_135m(cls, **overrides: Any) -> ModelConfig:
        """The shape of SmolLM2-135M (Llama architecture, tied embeddings)."""
        base: dict[str, Any] = dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            bos_token_id=1,
            eos_token_id=2,
        )
        base.update(overrides)
        return cls(**base)
