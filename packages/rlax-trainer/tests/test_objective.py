"""Every preset's loss and gradient against an independent float64 numpy reference.

The reference (`trainer_objective_reference.py`) writes each objective from its paper's
definition and differentiates it by central finite differences; it never calls the
library. The inputs are off-policy (ratios != 1, as in every minibatch after the first)
with tokens clipped on both sides, the KL penalty and the entropy bonus switched on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from trainer_objective_reference import Reference

from rlax_trainer.objective import (
    PRESET_NAMES,
    GroupNormalized,
    load_objective,
    objective_from_dict,
    objective_loss,
    objective_to_dict,
    prepare_batch,
    preset,
    register_advantage,
)

G, NG, T = 4, 3, 10
B = G * NG
# Every clip boundary of the presets' token ratios: finite differences need data away from
# them (the clipped surrogate's gradient jumps there).
TOKEN_BOUNDARIES = (0.8, 1.2, 1.28)
MARGIN = 1e-3


def make_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T))
    for i in range(B):
        start = rng.integers(0, 3)
        length = rng.integers(1, T - start + 1)
        mask[i, start : start + length] = 1.0
    lp = -rng.uniform(0.05, 3.0, size=(B, T))
    old = lp + rng.normal(0, 0.2, size=(B, T))
    # A few sequences nearly on-policy so sequence-level (GSPO) ratios land inside the tiny clip range.
    old[::3] = lp[::3] + rng.normal(0, 1e-4, size=(len(range(0, B, 3)), T))
    for b in TOKEN_BOUNDARIES:  # move token ratios off the clip boundaries
        near = np.abs((lp - old) - np.log(b)) < MARGIN
        old = np.where(near, old + 5 * MARGIN, old)
    rewards = np.where(rng.random(B) < 0.5, rng.integers(0, 2, size=B).astype(float), rng.normal(size=B))
    values = rng.normal(size=(B, T))
    return {
        "mask": mask,
        "logprobs": lp,
        "old_logprobs": old,
        "ref_logprobs": lp + rng.normal(0, 0.3, size=(B, T)),
        "infer_logprobs": old + rng.normal(0, 0.2, size=(B, T)),
        "entropy": rng.uniform(0.1, 2.0, size=(B, T)),
        "values": values,
        "old_values": values + rng.normal(0, 0.3, size=(B, T)),
        "rewards": rewards,
        # pi_prox on the sampler's top-p/top-k support: the truncated distribution's log-prob
        # is the full one's minus log(kept mass), so never lower.
        "sampler_old_logprobs": old + rng.uniform(0.0, 0.3, size=(B, T)),
    }


def lib_objective(cfg, x: dict):
    """The library's loss and its autodiff gradients w.r.t. logprobs, entropy and values."""
    j = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
    prep = prepare_batch(cfg, j["rewards"], j["mask"], G, old_values=j["old_values"] if cfg.value else None)

    def f(lp, ent, v):
        loss, _ = objective_loss(
            cfg,
            logprobs=lp,
            old_logprobs=j["old_logprobs"],
            advantages=prep.advantages,
            weights=prep.weights,
            mask=j["mask"],
            ref_logprobs=j["ref_logprobs"],
            infer_logprobs=j["infer_logprobs"],
            sampler_old_logprobs=j.get("sampler_old_logprobs"),
            entropy=ent,
            values=v,
            old_values=j["old_values"],
            returns=prep.returns,
        )
        return loss

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(j["logprobs"], j["entropy"], j["values"])
    return float(loss), *(np.asarray(g, np.float64) for g in grads)


def lib_metrics(cfg, x: dict) -> dict[str, float]:
    j = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
    prep = prepare_batch(cfg, j["rewards"], j["mask"], G)
    _, m = objective_loss(
        cfg,
        logprobs=j["logprobs"],
        old_logprobs=j["old_logprobs"],
        advantages=prep.advantages,
        weights=prep.weights,
        mask=j["mask"],
        ref_logprobs=j["ref_logprobs"],
        infer_logprobs=j["infer_logprobs"],
        sampler_old_logprobs=j["sampler_old_logprobs"],
    )
    return {k: float(v) for k, v in m.items()}


def assert_clipped_on_both_sides(ref: Reference) -> None:
    """Ratios differ from 1; some tokens (sequences, for GSPO) are clipped above with A > 0
    and below with A < 0 (where the preset has a lower bound), some GSPO sequences are
    inside its tiny range, and none sits within reach of finite differences of a boundary."""
    c = ref.clip_counts()
    assert c.max_abs_log_ratio > 0.1, "off-policy data: ratios must differ from 1"
    if ref.cfg["importance"]["clip"] == "none":
        return
    assert c.boundary_distance > 1e-5, "a ratio sits on a clip boundary"
    assert c.above > 0, "no ratio clipped above"
    assert c.below > 0 or ref.lo <= 0, "no ratio clipped below"
    assert c.inside > 0, "no ratio inside the clip range"


# KL (k3 unless the preset picks its own estimator) and entropy on for every preset.
REGULARISED = {"entropy_coef": 0.01}
VARIANTS = (
    [(name, {}) for name in PRESET_NAMES]
    + [(name, {"kl": {"coef": 0.05}, **REGULARISED}) for name in PRESET_NAMES]
    + [
        ("grpo", {"entropy_coef": 0.01, "importance": {"tis_cap": 2.0}}),
        ("grpo", {"kl": {"estimator": "k1"}, "advantage": {"ddof": 1}}),
        (
            "reinforce_pp",
            {"kl": {"estimator": "k3", "coef": 0.1}, "advantage": {"subtract_group_mean": True}},
        ),
        ("dapo", {"overlong": {"max_length": 8, "cache_length": 4, "penalty": 0.5}}),
        ("dr_grpo", {"max_length": 16, "kl": {"coef": 0.05, "estimator": "k2"}}),
        ("gspo", {"importance": {"tis_cap": 1.5}, "kl": {"coef": 0.05}}),
        ("cispo", {"importance": {"tis_cap": 1.5}, "kl": {"coef": 0.05}}),
        ("ppo", {"advantage": {"normalize": False, "lam": 0.9, "gamma": 0.97}, "value": {"clip": None}}),
    ]
)


def check_against_reference(name: str, cfg, x: dict) -> Reference:
    ref = Reference(objective_to_dict(cfg), x, G)
    assert_clipped_on_both_sides(ref)
    want_lp, want_ent, want_v = ref.gradients()
    got = lib_objective(cfg, x)
    np.testing.assert_allclose(got[0], ref.logged_loss(), rtol=1e-5, atol=1e-5, err_msg=f"{name} loss")
    for label, g, w in zip(
        ("logprobs", "entropy", "values"), got[1:], (want_lp, want_ent, want_v), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{name} d/d{label}")
    assert np.abs(want_lp).sum() > 0, "the reference gradient must not be trivially zero"
    return ref


@pytest.mark.parametrize(
    ("name", "overrides"), VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS)]
)
def test_loss_and_gradient_match_float64_reference(name, overrides):
    cfg = preset(name, **overrides)
    for seed in range(2):
        check_against_reference(name, cfg, make_inputs(seed))


# Off-policy correction (decoupled PPO's w = pi_prox / pi_behav, plain, truncated or masked,
# per token or per sequence), with KL on; the data puts behaviour ratios on both sides of
# every bound.
CORRECTIONS = [
    ("grpo", {"kind": "is"}),
    ("grpo", {"kind": "tis", "upper": 1.3}),
    ("dapo", {"kind": "tis", "upper": 1.3, "lower": 0.9}),
    ("grpo", {"kind": "mis", "upper": 1.3, "lower": 0.9}),
    ("cispo", {"kind": "mis", "upper": 1.3, "lower": 0.9}),
    ("grpo", {"kind": "tis", "level": "sequence", "upper": 3.0, "lower": 1.2}),
    ("dapo", {"kind": "mis", "level": "sequence", "upper": 3.0, "lower": 1.2}),
    ("gspo", {"kind": "tis", "upper": 1.2, "lower": 1.1}),
    ("gspo", {"kind": "mis", "level": "sequence", "upper": 1.2, "lower": 1.1}),
]


@pytest.mark.parametrize(
    ("name", "correction"),
    CORRECTIONS,
    ids=[f"{n}-{c['kind']}-{c.get('level', 'auto')}-{i}" for i, (n, c) in enumerate(CORRECTIONS)],
)
def test_off_policy_correction_matches_float64_reference(name, correction):
    cfg = preset(name, importance={"correction": correction}, kl={"coef": 0.05})
    x = make_inputs(0)
    ref = check_against_reference(name, cfg, x)
    counts = ref.correction_counts()
    if correction["kind"] != "is":
        assert counts.above > 0 and counts.inside > 0, counts
        assert counts.below > 0 or "lower" not in correction, counts
    m = lib_metrics(cfg, x)
    ratios, corrected = np.asarray(ref.behav_ratio), np.asarray(ref.corrected)
    # The reference lists one ratio per token, or per sequence at sequence level.
    per_token = np.repeat(ratios, x["mask"].sum(axis=1).astype(int)) if len(ratios) == B else ratios
    np.testing.assert_allclose(m["behav_ratio_max"], per_token.max(), rtol=1e-5)
    np.testing.assert_allclose(m["behav_ratio_min"], per_token.min(), rtol=1e-5)
    np.testing.assert_allclose(m["behav_ratio_mean"], per_token.mean(), rtol=1e-5)
    flags = np.repeat(corrected, x["mask"].sum(axis=1).astype(int)) if len(corrected) == B else corrected
    np.testing.assert_allclose(m["behav_corrected_fraction"], flags.mean(), rtol=1e-6)
    assert (m["behav_corrected_fraction"] > 0) == (correction["kind"] != "is")


def test_tis_cap_is_the_token_or_sequence_tis_correction():
    """`tis_cap` (older configs) means `correction: {kind: tis, upper: cap}` at the ratio's level."""
    x = make_inputs(1)
    for name, level in (("grpo", "token"), ("gspo", "sequence")):
        old = lib_objective(preset(name, importance={"tis_cap": 1.3}), x)
        new_cfg = preset(name, importance={"correction": {"kind": "tis", "level": level, "upper": 1.3}})
        new = lib_objective(new_cfg, x)
        assert old[0] == new[0] and all(np.array_equal(a, b) for a, b in zip(old[1:], new[1:], strict=True))
    with pytest.raises(msgspec.ValidationError, match="either tis_cap"):
        preset("grpo", importance={"tis_cap": 2.0, "correction": {"kind": "mis", "upper": 2.0}})
    with pytest.raises(msgspec.ValidationError, match="needs `upper`"):
        preset("grpo", importance={"correction": {"kind": "mis"}})
    with pytest.raises(msgspec.ValidationError, match="level: token under importance.level: sequence"):
        preset("gspo", importance={"correction": {"kind": "tis", "level": "token", "upper": 2.0}})


def test_clipped_token_keeps_kl_gradient_and_logs_clipped_value():
    """Hand-worked: one group of two one-token samples, GRPO (eps 0.2, k3 KL, beta 0.04).

    Rewards (1, 0) give A = (+1, -1) (std 0.5, eps 1e-6 ignored at this tolerance); both
    ratios exp(+-0.5) = (1.6487, 0.6065) are clipped, so the surrogate has no gradient
    and is worth -(1/2) * (1.2 * 1 + 0.8 * -1) = -0.2. With ref - logp = 0.3 on both
    tokens: KL = e^0.3 - 1.3 = 0.049859 each, gradient per token (1/2) * 0.04 * (1 - e^0.3)
    = -0.0069972.
    """
    cfg = preset("grpo")
    lp = jnp.array([[-1.0], [-1.0]])
    prep = prepare_batch(cfg, jnp.array([1.0, 0.0]), jnp.ones((2, 1)), 2)

    def f(logprobs):
        return objective_loss(
            cfg,
            logprobs=logprobs,
            old_logprobs=jnp.array([[-1.5], [-0.5]]),
            advantages=prep.advantages,
            weights=prep.weights,
            mask=jnp.ones((2, 1)),
            ref_logprobs=lp + 0.3,
        )

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(lp)
    assert float(metrics["clip_fraction"]) == 1.0
    np.testing.assert_allclose(float(metrics["pg_loss"]), -0.2, rtol=1e-5)
    np.testing.assert_allclose(float(loss), -0.2 + 0.04 * 0.049859, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[:, 0], [-0.0069972, -0.0069972], rtol=1e-4)


def test_clipping_is_exercised():
    x = make_inputs(0)
    cfg = preset("grpo")
    j = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
    prep = prepare_batch(cfg, j["rewards"], j["mask"], G)
    _, m = objective_loss(
        cfg,
        logprobs=j["logprobs"] * 1.3,
        old_logprobs=j["old_logprobs"],
        advantages=prep.advantages,
        weights=prep.weights,
        mask=j["mask"],
        ref_logprobs=j["ref_logprobs"],
    )
    assert 0.0 < float(m["clip_fraction"]) < 1.0
    assert float(m["is_ratio_max"]) > 1.2 and float(m["is_ratio_min"]) < 0.8


def test_unknown_preset_and_bad_fields_are_named():
    with pytest.raises(ValueError, match="unknown objective preset 'nope'"):
        preset("nope")
    with pytest.raises(
        msgspec.ValidationError, match=r"eps_high must be >= 0, got -1.0 - at `\$.importance`"
    ):
        preset("grpo", importance={"eps_high": -1})
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `eps_hi` - at `\$.importance`"):
        preset("grpo", importance={"eps_hi": 0.3})
    with pytest.raises(msgspec.ValidationError, match=r"unknown advantage kind 'zzz'.*`\$.advantage`"):
        preset("grpo", advantage={"kind": "zzz"})
    with pytest.raises(msgspec.ValidationError, match=r"eps must be > 0, got -1.0.*`\$.advantage`"):
        preset("grpo", advantage={"eps": -1})
    with pytest.raises(msgspec.ValidationError, match="needs a value head"):
        preset("grpo", advantage={"kind": "gae"})
    with pytest.raises(msgspec.ValidationError, match=r"Expected `float`, got `str` - at `\$.kl.coef`"):
        preset("grpo", kl={"coef": "big"})
    with pytest.raises(ValueError, match="leave_one_out needs group_size >= 2"):
        prepare_batch(preset("rloo"), jnp.ones(3), jnp.ones((3, 4)), 1)
    with pytest.raises(ValueError, match="not a whole number of groups"):
        prepare_batch(preset("grpo"), jnp.ones(6), jnp.ones((6, 4)), 4)


def test_yaml_composition(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: dapo\nimportance: {eps_high: 0.3, tis_cap: 2.0}\nentropy_coef: 0.001\n")
    cfg = load_objective(path)
    assert cfg.importance.eps_high == 0.3 and cfg.importance.eps_low == 0.2 and cfg.importance.tis_cap == 2.0
    assert cfg.aggregation == "token_mean" and cfg.overlong is not None and cfg.entropy_coef == 0.001
    assert objective_from_dict(objective_to_dict(cfg)) == cfg
    path.write_text("base: grpo\naggregation: per_token\n")
    with pytest.raises(
        msgspec.ValidationError, match=r"mine.yaml.*Invalid enum value 'per_token' - at `\$.aggregation`"
    ):
        load_objective(path)


class _Median(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind = "group_median_test"
    needs_values = False

    def compute(self, rewards, mask, group_size, values=None):
        g = rewards.reshape(-1, group_size)
        return (g - jnp.median(g, axis=1, keepdims=True)).reshape(-1)[:, None] * mask, None


def test_registered_advantage_plugin():
    register_advantage(_Median)
    cfg = preset("grpo", advantage={"kind": "group_median_test"})
    prep = prepare_batch(cfg, jnp.array([0.0, 1.0, 5.0, 0.0]), jnp.ones((4, 2)), 4)
    np.testing.assert_allclose(prep.advantages[:, 0], [-0.5, 0.5, 4.5, -0.5])
    assert isinstance(preset("grpo").advantage, GroupNormalized)
