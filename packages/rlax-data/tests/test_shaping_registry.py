from __future__ import annotations

import msgspec
import pytest

from rlax_data import CodeTests, Record
from rlax_data.tasks import ArithmeticTask, CountdownTask
from rlax_data.verify import (
    CodeConfig,
    CountdownConfig,
    ExactMatchConfig,
    OverlongConfig,
    RoutingConfig,
    RoutingVerifier,
    ShapedConfig,
    ShapedVerifier,
    ShapingConfig,
    VerifyResult,
    build_verifier,
    load_verifier_config,
    overlong_penalty,
    register_verifier,
)


def test_overlong_penalty_shape():
    # DAPO: free up to L_max - L_cache, linear to -1 at L_max, -1 beyond.
    assert overlong_penalty(10, 20, 5) == 0.0
    assert overlong_penalty(15, 20, 5) == 0.0
    assert overlong_penalty(16, 20, 5) == pytest.approx(-0.2)
    assert overlong_penalty(20, 20, 5) == pytest.approx(-1.0)
    assert overlong_penalty(21, 20, 5) == -1.0
    with pytest.raises(ValueError):
        overlong_penalty(1, 5, 6)


def test_shaped_verifier_format_and_length():
    task = ArithmeticTask()
    rec = task.generate(1, seed=0)[0]
    cfg = ShapingConfig(
        format_regex=r"\d+", format_reward=0.1, overlong=OverlongConfig(max_tokens=8, cache_tokens=2)
    )
    v = ShapedVerifier(task.verifier(), cfg)
    right, padded, wrong_fmt, long = v.verify(
        [(rec.answer, rec), (rec.answer + "\n  ", rec), ("x", rec), (rec.answer + "\n" + "9" * 10, rec)]
    )
    assert right.reward == pytest.approx(1.1) and right.correct and right.details["format_ok"]
    assert padded.correct and padded.reward == pytest.approx(1.0)  # right answer, format broken
    assert not wrong_fmt.correct and wrong_fmt.reward == 0.0
    assert (
        long.correct and long.reward == pytest.approx(1.0 - 1.0) and long.details["overlong_penalty"] == -1.0
    )
    tok = ShapedVerifier(
        task.verifier(), ShapingConfig(overlong=OverlongConfig(max_tokens=4, cache_tokens=2)), len
    )
    assert tok.verify([("1234", rec)])[0].details["overlong_penalty"] == pytest.approx(-1.0)


def test_config_registry_round_trip_and_errors():
    data = {
        "kind": "routing",
        "routes": {
            "arithmetic": {"kind": "exact"},
            "countdown": {"kind": "shaped", "base": {"kind": "countdown"}, "shaping": {"format_reward": 0.5}},
            "code": {"kind": "code", "sandbox": {"timeout_s": 3, "workers": 1}},
        },
        "default": "arithmetic",
    }
    cfg = load_verifier_config(data)
    assert isinstance(cfg, RoutingConfig) and isinstance(cfg.routes["countdown"], ShapedConfig)
    assert msgspec.to_builtins(cfg)["routes"]["code"]["sandbox"]["timeout_s"] == 3
    assert load_verifier_config(msgspec.to_builtins(cfg)) == cfg
    v = build_verifier(cfg)
    assert isinstance(v, RoutingVerifier)
    arith = ArithmeticTask().generate(3, seed=1)
    cd = CountdownTask().generate(2, seed=1)
    code = Record(id="k", prompt="p", task="code", tests=CodeTests(script="assert 1 + 1 == 2"))
    plain = Record(id="p", prompt="q", answer="ok")  # no task: goes to the default route
    items = [
        (arith[0].answer, arith[0]),
        (cd[0].answer, cd[0]),
        ("x = 1", code),
        ("nope", arith[1]),
        ("ok", plain),
    ]
    res = v.verify(items)
    assert [r.correct for r in res] == [True, True, True, False, True]
    assert res[1].reward == pytest.approx(1.0)  # no format regex: format reward never applies
    with pytest.raises(ValueError, match="sandbox.cpu_s"):
        load_verifier_config({"kind": "code", "sandbox": {"cpu_s": 0}})
    with pytest.raises(ValueError, match="unknown field `nope`"):
        load_verifier_config({"kind": "exact", "nope": 1})
    with pytest.raises(ValueError, match="default"):
        RoutingConfig(routes={"a": ExactMatchConfig()}, default="b")
    with pytest.raises(ValueError, match="field `task`"):
        RoutingVerifier({"x": build_verifier(CountdownConfig())}).verify([("1", arith[0])])
    assert isinstance(CodeConfig().sandbox.timeout_s, float)


class ConstConfig(msgspec.Struct, frozen=True, tag_field="kind", tag="const"):
    value: float = 0.25


class ConstVerifier:
    def __init__(self, cfg: ConstConfig) -> None:
        self.cfg = cfg

    def verify(self, items):
        return [VerifyResult(reward=self.cfg.value, correct=False) for _ in items]


def test_register_a_new_verifier_kind():
    register_verifier(ConstConfig, ConstVerifier)
    cfg = load_verifier_config({"kind": "const", "value": 0.5})
    assert build_verifier(cfg).verify([("x", ArithmeticTask().generate(1, seed=0)[0])])[0].reward == 0.5
    with pytest.raises(TypeError, match="tag"):
        register_verifier(msgspec.Struct, ConstVerifier)
