"""Every preset's loss and gradient against an independent float64 numpy implementation.

The numpy code below re-derives the formula from the papers' definitions and does not
call the library: advantages with explicit loops, per-token aggregation weights, the
PPO clip mask, TIS, the KL estimators' analytic derivatives, and the value loss's
gradient by central finite differences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest

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


def make_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T))
    for i in range(B):
        start = rng.integers(0, 3)
        length = rng.integers(1, T - start + 1)
        mask[i, start : start + length] = 1.0
    lp = -rng.uniform(0.05, 3.0, size=(B, T))
    old = lp + rng.normal(0, 0.15, size=(B, T))
    # A few sequences nearly on-policy so sequence-level (GSPO) ratios land inside the tiny clip range.
    old[::3] = lp[::3] + rng.normal(0, 1e-4, size=(len(range(0, B, 3)), T))
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
    }


# ----------------------------------------------------------------------------- numpy reference
def np_shape_rewards(cfg: dict, rewards, mask):
    ov = cfg.get("overlong")
    if not ov:
        return rewards.copy()
    out = rewards.copy()
    for i in range(B):
        n = mask[i].sum()
        start = ov["max_length"] - ov["cache_length"]
        if n <= start:
            pen = 0.0
        elif n <= ov["max_length"]:
            pen = (start - n) / ov["cache_length"] * ov["penalty"]
        else:
            pen = -ov["penalty"]
        out[i] += pen
    return out


def np_advantages(adv: dict, rewards, mask, old_values):
    kind = adv["kind"]
    seq = np.zeros(B)
    if kind in ("group_norm", "group_centered", "leave_one_out"):
        for g0 in range(0, B, G):
            grp = rewards[g0 : g0 + G]
            for j in range(G):
                if kind == "group_norm":
                    seq[g0 + j] = (grp[j] - grp.mean()) / (np.std(grp, ddof=adv["ddof"]) + adv["eps"])
                elif kind == "group_centered":
                    seq[g0 + j] = grp[j] - grp.mean()
                else:
                    seq[g0 + j] = grp[j] - (grp.sum() - grp[j]) / (G - 1)
        return seq[:, None] * mask, None
    if kind == "batch_norm":
        r = rewards.copy()
        if adv["subtract_group_mean"]:
            r = r - np.repeat(r.reshape(-1, G).mean(axis=1), G)
        return ((r - r.mean()) / (r.std() + adv["eps"]))[:, None] * mask, None
    assert kind == "gae"
    gamma, lam = adv["gamma"], adv["lam"]
    a = np.zeros((B, T))
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        nxt = 0.0
        for t in reversed(idx):
            last = t == idx[-1]
            v_next = 0.0 if last else old_values[i, t + 1]
            delta = (rewards[i] if last else 0.0) + gamma * v_next - old_values[i, t]
            a[i, t] = delta + (0.0 if last else gamma * lam * nxt)
            nxt = a[i, t]
    returns = a + old_values * mask
    if adv["normalize"]:
        vals = a[mask > 0]
        a = (a - vals.mean()) / (vals.std() + adv["eps"]) * mask
    return a, returns


def np_weights(cfg: dict, mask):
    lengths = mask.sum(axis=1)
    w = np.zeros((B, T))
    for i in range(B):
        grp = i // G
        if cfg["aggregation"] == "sequence":
            w[i] = mask[i] / (NG * G * lengths[i])
        elif cfg["aggregation"] == "token_mean":
            w[i] = mask[i] / (NG * lengths[grp * G : grp * G + G].sum())
        else:
            w[i] = mask[i] / (NG * G * (cfg["max_length"] or T))
    return w


def np_kl_and_grad(est: str, lp, ref):
    d = ref - lp
    if est == "k1":
        return -d, np.ones_like(d)
    if est == "k2":
        return 0.5 * d * d, -d
    return np.exp(d) - 1 - d, 1 - np.exp(d)


def np_value_loss(vcfg: dict, w, v, old_v, ret):
    err = (v - ret) ** 2
    if vcfg["clip"] is not None:
        err = np.maximum(err, (old_v + np.clip(v - old_v, -vcfg["clip"], vcfg["clip"]) - ret) ** 2)
    return vcfg["coef"] * (w * 0.5 * err).sum()


def np_objective(cfg: dict, x: dict):
    """Returns loss and the gradients w.r.t. logprobs, entropy and values, all float64."""
    mask = x["mask"]
    lp, old = x["logprobs"], x["old_logprobs"]
    rewards = np_shape_rewards(cfg, x["rewards"], mask)
    adv, returns = np_advantages(cfg["advantage"], rewards, mask, x["old_values"])
    w = np_weights(cfg, mask)
    imp = cfg["importance"]
    if imp["level"] == "token":
        ratio = np.exp(lp - old)
    else:
        ratio = np.zeros((B, T))
        for i in range(B):
            n = mask[i].sum()
            ratio[i, :] = np.exp(((lp[i] - old[i]) * mask[i]).sum() / n)
    lo, hi = 1 - imp["eps_low"], 1 + imp["eps_high"]
    if imp["clip"] == "mask":
        keep = ~(((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo)))
        is_w = ratio * keep
    elif imp["clip"] == "truncate":
        is_w = np.clip(ratio, lo, hi)
    else:
        is_w = ratio
    if imp["tis_cap"] is not None:
        is_w = is_w * np.minimum(np.exp(old - x["infer_logprobs"]), imp["tis_cap"])
    c = w * is_w * mask
    term2 = np.zeros((B, T))
    dterm2 = np.zeros((B, T))
    if cfg["kl"]["coef"] > 0:
        k, dk = np_kl_and_grad(cfg["kl"]["estimator"], lp, x["ref_logprobs"])
        term2 += cfg["kl"]["coef"] * k
        dterm2 += cfg["kl"]["coef"] * dk
    term2 -= cfg["entropy_coef"] * x["entropy"]
    loss = (c * (adv * -1.0 + term2)).sum()
    g_lp = c * (-adv + dterm2)
    g_ent = -cfg["entropy_coef"] * c
    g_v = np.zeros((B, T))
    if cfg["value"] is not None:
        vl = lambda v: np_value_loss(cfg["value"], w, v, x["old_values"], returns)  # noqa: E731
        loss += vl(x["values"])
        h = 1e-6
        for i in range(B):
            for t in range(T):
                e = np.zeros((B, T))
                e[i, t] = h
                g_v[i, t] = (vl(x["values"] + e) - vl(x["values"] - e)) / (2 * h)
    return loss, g_lp, g_ent, g_v


# ----------------------------------------------------------------------------- library side
def lib_objective(cfg, x: dict):
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
            entropy=ent,
            values=v,
            old_values=j["old_values"],
            returns=prep.returns,
        )
        return loss

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(j["logprobs"], j["entropy"], j["values"])
    return float(loss), *(np.asarray(g, np.float64) for g in grads)


VARIANTS = [(name, {}) for name in PRESET_NAMES] + [
    ("grpo", {"entropy_coef": 0.01, "importance": {"tis_cap": 2.0}}),
    ("grpo", {"kl": {"estimator": "k1"}, "advantage": {"ddof": 1}}),
    ("reinforce_pp", {"kl": {"estimator": "k3", "coef": 0.1}, "advantage": {"subtract_group_mean": True}}),
    ("dapo", {"overlong": {"max_length": 8, "cache_length": 4, "penalty": 0.5}}),
    ("dr_grpo", {"max_length": 16}),
    ("gspo", {"importance": {"tis_cap": 1.5}}),
    ("ppo", {"advantage": {"normalize": False, "lam": 0.9, "gamma": 0.97}, "value": {"clip": None}}),
]


@pytest.mark.parametrize(
    ("name", "overrides"), VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS)]
)
def test_loss_and_gradient_match_numpy(name, overrides):
    cfg = preset(name, **overrides)
    cfg_dict = objective_to_dict(cfg)
    for seed in range(2):
        x = make_inputs(seed)
        want = np_objective(cfg_dict, x)
        got = lib_objective(cfg, x)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5, err_msg=f"{name} loss")
        for label, g, w in zip(("logprobs", "entropy", "values"), got[1:], want[1:], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{name} d/d{label}")
        assert np.abs(want[1]).sum() > 0, "the reference gradient must not be trivially zero"


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
