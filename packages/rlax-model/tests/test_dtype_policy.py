"""The dtype policy: bfloat16 on a CPU computes in float32 and says so, unless forced."""

import logging

import pytest

from rlax_model import BF16_ON_CPU_ENV, ModelConfig, dtype_policy, resolve_dtypes

BF16 = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(BF16_ON_CPU_ENV, raising=False)


@pytest.mark.parametrize(
    ("requested", "platform", "expected"),
    [
        (("bfloat16", "bfloat16"), "cpu", ("float32", "float32")),
        (("bfloat16", "float32"), "cpu", ("float32", "float32")),
        (("float32", "bfloat16"), "cpu", ("float32", "float32")),
        (("float32", "float32"), "cpu", ("float32", "float32")),
        (("bfloat16", "bfloat16"), "tpu", ("bfloat16", "bfloat16")),
        (("bfloat16", "bfloat16"), "gpu", ("bfloat16", "bfloat16")),
        (("bfloat16", "bfloat16"), "cuda", ("bfloat16", "bfloat16")),
        (("bfloat16", "float32"), "tpu", ("bfloat16", "float32")),
    ],
)
def test_resolve_dtypes_table(requested, platform, expected):
    assert resolve_dtypes(*requested, platform) == expected


def test_compute_dtype_defaults_to_param_dtype():
    assert resolve_dtypes("bfloat16", None, "tpu") == ("bfloat16", "bfloat16")
    assert resolve_dtypes("bfloat16", None, "cpu") == ("float32", "float32")


def test_default_platform_is_jax_default_backend():
    # The test suite runs with JAX_PLATFORMS=cpu.
    assert resolve_dtypes("bfloat16") == ("float32", "float32")


def test_opt_out_argument_and_environment(monkeypatch):
    assert resolve_dtypes("bfloat16", "bfloat16", "cpu", allow_bf16_on_cpu=True) == ("bfloat16", "bfloat16")
    monkeypatch.setenv(BF16_ON_CPU_ENV, "1")
    assert resolve_dtypes("bfloat16", "bfloat16", "cpu") == ("bfloat16", "bfloat16")
    # An explicit argument wins over the environment.
    assert resolve_dtypes("bfloat16", "bfloat16", "cpu", allow_bf16_on_cpu=False) == ("float32", "float32")
    for off in ("0", "", "no", "false"):
        monkeypatch.setenv(BF16_ON_CPU_ENV, off)
        assert resolve_dtypes("bfloat16", "bfloat16", "cpu") == ("float32", "float32")


def test_policy_logs_one_line_with_the_reason_and_the_opt_out(caplog):
    with caplog.at_level(logging.INFO, logger="rlax.model"):
        effective = dtype_policy(BF16, "cpu")
    assert (effective.param_dtype, effective.compute_dtype) == ("float32", "float32")
    # Everything else is the requested model.
    assert effective.replace(param_dtype="bfloat16", compute_dtype="bfloat16") == BF16
    records = [r for r in caplog.records if r.name == "rlax.model"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    line = records[0].getMessage()
    assert "\n" not in line
    for part in ("bfloat16", "CPU", "float32", "slower", f"{BF16_ON_CPU_ENV}=1"):
        assert part in line, (part, line)


@pytest.mark.parametrize(
    ("config", "platform", "allow"),
    [
        (BF16, "tpu", None),
        (BF16, "cpu", True),
        (ModelConfig.tiny(), "cpu", None),
    ],
)
def test_policy_is_silent_and_returns_the_config_when_nothing_changes(caplog, config, platform, allow):
    with caplog.at_level(logging.INFO, logger="rlax.model"):
        assert dtype_policy(config, platform, allow_bf16_on_cpu=allow) is config
    assert not [r for r in caplog.records if r.name == "rlax.model"]


def test_policy_is_idempotent(caplog):
    once = dtype_policy(BF16, "cpu")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlax.model"):
        assert dtype_policy(once, "cpu") is once
    assert not caplog.records
