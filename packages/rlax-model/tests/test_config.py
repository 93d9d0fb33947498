"""ModelConfig validation: every bad field is named with its value."""

from __future__ import annotations

import jax
import pytest

from rlax_model import ConfigError, LinearRopeScaling, Llama3RopeScaling, ModelConfig


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("vocab_size", 0, r"ModelConfig\.vocab_size=0"),
        ("hidden_size", 64.0, r"ModelConfig\.hidden_size=64\.0"),
        ("num_kv_heads", 3, r"ModelConfig\.num_kv_heads=3: must divide num_heads=4"),
        ("head_dim", 15, r"ModelConfig\.head_dim=15"),
        ("rope_theta", -1.0, r"ModelConfig\.rope_theta=-1\.0"),
        ("param_dtype", "float16", r"ModelConfig\.param_dtype='float16'"),
        ("compute_dtype", "fp8", r"ModelConfig\.compute_dtype='fp8'"),
        ("architecture", "gpt2", r"ModelConfig\.architecture='gpt2'"),
        ("eos_token_id", 500, r"ModelConfig\.eos_token_id=500"),
        ("bos_token_id", -1, r"ModelConfig\.bos_token_id=-1"),
        ("qk_norm", "yes", r"ModelConfig\.qk_norm='yes'"),
        ("rope_scaling", {"type": "linear"}, r"ModelConfig\.rope_scaling="),
    ],
)
def test_bad_field_is_named(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.tiny(**{field: value})


def test_rope_scaling_validation():
    with pytest.raises(ConfigError, match=r"LinearRopeScaling\.factor=0"):
        LinearRopeScaling(factor=0)
    with pytest.raises(ConfigError, match=r"Llama3RopeScaling\.high_freq_factor=1\.0"):
        Llama3RopeScaling(low_freq_factor=1.0, high_freq_factor=1.0)


def test_config_is_hashable_and_static():
    a = ModelConfig.tiny(eos_token_id=[2, 3])
    b = ModelConfig.tiny(eos_token_id=(2, 3))
    assert a == b and hash(a) == hash(b)
    assert a.eos_token_ids == (2, 3)
    assert jax.jit(lambda x, config: x * config.num_layers, static_argnames="config")(1.0, config=a) == 2.0
    assert ModelConfig.smollm2_135m().num_params() == 134_515_008
