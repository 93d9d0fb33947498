"""Float64 numpy references of every objective preset, written from the papers' definitions.

Nothing here calls `rlax_trainer`: each objective is spelled out as its paper writes it
(the policy surrogate with `min(r A, clip(r) A)`, the KL penalty and the entropy bonus
added outside it), and gradients come from central finite differences of these losses,
not from any analytic derivative. Batch layout: `B = NG * G` rows, the G samples of a
prompt contiguous; every array is [B, T] with `mask` marking response tokens.

- GRPO (DeepSeekMath, eq. 3): `1/G sum_i 1/|o_i| sum_t [min(r A, clip(r, 1-e, 1+e) A)
  - beta * D_KL]`, `D_KL = pi_ref/pi - log(pi_ref/pi) - 1` (k3), `A` group-normalised.
- DAPO: clip-higher (e_low, e_high), token-mean `1/sum_i |o_i| sum_i sum_t`, soft
  overlong punishment added to the reward.
- Dr. GRPO: `A = R - mean(R)` (no std), `1/(G * L_max) sum_i sum_t`.
- RLOO: `A_i = R_i - mean_{j != i} R_j`.
- REINFORCE++: `A` whitened over the whole batch; KL as a loss term (k2 here, OpenRLHF's
  `use_kl_loss`).
- GSPO: sequence ratio `s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)`,
  `1/G sum_i min(s_i A_i, clip(s_i) A_i)`.
- CISPO (MiniMax-M1): `1/sum_i |o_i| sum_i sum_t sg[clip(r, 1-e_low, 1+e_high)] A log pi`.
- PPO: GAE(gamma, lambda) from the old value head with the reward on the last token,
  whitened; value loss `coef * 0.5 * max((V - R)^2, (V_old + clip(V - V_old) - R)^2)`.

Off-policy correction (`importance.correction`, or the older `tis_cap`), by explicit loops:

- Decoupled PPO (AReaL, Fu et al. 2025): each policy term is multiplied by the constant
  behaviour weight `w = pi_prox / pi_behav`, `w * min(r A, clip(r) A)` with `r = pi /
  pi_prox`; pi_prox is `old_logprobs` in the clip and `sampler_old_logprobs` (pi_prox on
  the sampler's top-p/top-k support; `old_logprobs` when absent) in `w`, pi_behav is
  `infer_logprobs`.
- TIS (Yao et al. 2025): `w -> min(w, C)` (and `max(., lower)` when a lower bound is set).
- MIS (IcePop-style masking): `w -> w` if `lower <= w <= upper`, else 0.
- Sequence level: `W_i = prod_t w_{i,t}` over the response (a token-level policy ratio),
  `W_i = (prod_t w_{i,t})^(1/|y_i|)` under GSPO's sequence ratio; truncated or masked as a
  whole and applied to every token of the response.

Every objective's loss is the negated objective, averaged over prompts (groups).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np


def shaped_rewards(cfg: dict, rewards: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """DAPO's soft overlong punishment: 0 up to L_max - L_cache, linear to -penalty at L_max."""
    ov = cfg.get("overlong")
    out = rewards.astype(np.float64).copy()
    if not ov:
        return out
    for i in range(len(out)):
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


def advantages(
    adv: dict, rewards: np.ndarray, mask: np.ndarray, old_values: np.ndarray, group: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (advantages [B, T] zero off-mask, value targets [B, T] or None), by explicit loops."""
    b, t = mask.shape
    kind = adv["kind"]
    seq = np.zeros(b)
    if kind in ("group_norm", "group_centered", "leave_one_out"):
        for g0 in range(0, b, group):
            grp = rewards[g0 : g0 + group]
            for j in range(group):
                if kind == "group_norm":
                    seq[g0 + j] = (grp[j] - grp.mean()) / (np.std(grp, ddof=adv["ddof"]) + adv["eps"])
                elif kind == "group_centered":
                    seq[g0 + j] = grp[j] - grp.mean()
                else:
                    seq[g0 + j] = grp[j] - (grp.sum() - grp[j]) / (group - 1)
        return seq[:, None] * mask, None
    if kind == "batch_norm":
        r = rewards.copy()
        if adv["subtract_group_mean"]:
            r = r - np.repeat(r.reshape(-1, group).mean(axis=1), group)
        return ((r - r.mean()) / (r.std() + adv["eps"]))[:, None] * mask, None
    assert kind == "gae", kind
    gamma, lam = adv["gamma"], adv["lam"]
    a = np.zeros((b, t))
    for i in range(b):
        idx = np.nonzero(mask[i])[0]
        running = 0.0
        for tt in reversed(idx):
            last = tt == idx[-1]
            v_next = 0.0 if last else old_values[i, tt + 1]
            delta = (rewards[i] if last else 0.0) + gamma * v_next - old_values[i, tt]
            running = delta + (0.0 if last else gamma * lam * running)
            a[i, tt] = running
    returns = a + old_values * mask
    if adv["normalize"]:
        vals = a[mask > 0]
        a = (a - vals.mean()) / (vals.std() + adv["eps"]) * mask
    return a, returns


def aggregate(kind: str, per_token: np.ndarray, mask: np.ndarray, group: int, l_max: int | None) -> float:
    """Mean over prompts of the per-prompt normalised token sum of `per_token` [B, T]."""
    b, t = mask.shape
    x = (per_token * mask).reshape(b // group, group, t)
    m = mask.reshape(b // group, group, t)
    if kind == "sequence":  # GRPO: 1/G sum_i 1/|o_i| sum_t
        per_prompt = (x.sum(axis=2) / m.sum(axis=2)).mean(axis=1)
    elif kind == "token_mean":  # DAPO: 1/sum_i |o_i| sum_i sum_t
        per_prompt = x.sum(axis=(1, 2)) / m.sum(axis=(1, 2))
    else:  # Dr. GRPO: 1/(G L_max) sum_i sum_t
        per_prompt = x.sum(axis=(1, 2)) / (group * (l_max or t))
    return float(per_prompt.mean())


def kl_penalty(estimator: str, logprobs: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Schulman's estimators of KL(pi || pi_ref) at tokens sampled from pi."""
    log_ratio = ref - logprobs  # log(pi_ref / pi)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return np.exp(log_ratio) - log_ratio - 1.0  # DeepSeekMath's D_KL


def behaviour_weight(imp: dict, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, list, list]:
    """-> (the constant weight [B, T] of every policy term, the raw behaviour ratios (one
    per token or per sequence), whether each was truncated or masked), by explicit loops."""
    mask = batch["mask"]
    b, t = mask.shape
    corr = dict(imp.get("correction") or {"kind": "none"})
    if imp["tis_cap"] is not None:  # the older spelling: TIS at the ratio's level
        corr = {"kind": "tis", "level": imp["level"], "upper": imp["tis_cap"], "lower": None}
    weight = np.ones((b, t))
    if corr["kind"] == "none":
        return weight, [], []
    level = corr.get("level") or imp["level"]
    upper = corr.get("upper") or np.inf
    lower = corr.get("lower") or 0.0
    prox = batch.get("sampler_old_logprobs", batch["old_logprobs"])
    ratios, corrected = [], []

    def corrected_weight(w: float) -> tuple[float, bool]:
        if corr["kind"] == "is":
            return w, False
        if corr["kind"] == "tis":
            return min(max(w, lower), upper), not lower <= w <= upper
        inside = lower <= w <= upper  # mis
        return (w if inside else 0.0), not inside

    for i in range(b):
        idx = np.nonzero(mask[i])[0]
        token_w = [np.exp(prox[i, tt]) / np.exp(batch["infer_logprobs"][i, tt]) for tt in idx]
        if level == "token":
            for tt, w in zip(idx, token_w, strict=True):
                weight[i, tt], c = corrected_weight(w)
                ratios.append(w)
                corrected.append(c)
        else:
            w = float(np.prod(token_w))
            if imp["level"] == "sequence":
                w = w ** (1.0 / len(idx))
            weight[i, :], c = corrected_weight(w)
            ratios.append(w)
            corrected.append(c)
    return weight * mask, ratios, corrected


class CorrectionCounts(NamedTuple):
    """Where the behaviour ratios sit (tokens, or sequences at sequence level)."""

    above: int  # ratio > upper
    below: int  # ratio < lower
    inside: int


class ClipCounts(NamedTuple):
    """Where the data sits relative to the clip range (sequences for GSPO, else tokens)."""

    above: int  # A > 0 and ratio > 1 + eps_high
    below: int  # A < 0 and ratio < 1 - eps_low
    inside: int  # 1 - eps_low < ratio < 1 + eps_high
    boundary_distance: float  # min |log(ratio / boundary)|
    max_abs_log_ratio: float  # of the token ratios


class Reference:
    """The loss of one preset config (as `objective_to_dict` writes it) on one batch.

    `loss(logprobs, entropy, values)` is the float64 loss; `cispo_value` marks the one
    preset whose logged value is not its differentiated function (see `logged_loss`).
    """

    def __init__(self, cfg: dict, batch: dict[str, np.ndarray], group: int) -> None:
        self.cfg, self.x, self.group = cfg, batch, group
        mask = batch["mask"]
        t = mask.shape[1]
        rewards = shaped_rewards(cfg, batch["rewards"], mask)
        self.adv, self.returns = advantages(cfg["advantage"], rewards, mask, batch["old_values"], group)
        imp = cfg["importance"]
        self.lo, self.hi = 1.0 - imp["eps_low"], 1.0 + imp["eps_high"]
        self.tis, self.behav_ratio, self.corrected = behaviour_weight(imp, batch)
        assert self.tis.shape == (mask.shape[0], t)

    def _agg(self, per_token: np.ndarray) -> float:
        return aggregate(
            self.cfg["aggregation"], per_token, self.x["mask"], self.group, self.cfg["max_length"]
        )

    def token_ratio(self, logprobs: np.ndarray) -> np.ndarray:
        return np.exp(logprobs - self.x["old_logprobs"])

    def sequence_ratio(self, logprobs: np.ndarray) -> np.ndarray:
        """GSPO's length-normalised sequence ratio, [B]."""
        mask = self.x["mask"]
        return np.exp(((logprobs - self.x["old_logprobs"]) * mask).sum(axis=1) / mask.sum(axis=1))

    def correction_counts(self) -> CorrectionCounts:
        imp = self.cfg["importance"]
        corr = imp.get("correction") or {}
        upper = imp["tis_cap"] or corr.get("upper") or np.inf
        lower = corr.get("lower") or 0.0
        r = np.asarray(self.behav_ratio)
        return CorrectionCounts(
            int((r > upper).sum()), int((r < lower).sum()), int(((r >= lower) & (r <= upper)).sum())
        )

    def clip_counts(self) -> ClipCounts:
        x, on = self.x, self.x["mask"] > 0
        r, a = self.token_ratio(x["logprobs"]), self.adv
        max_abs_log_ratio = float(np.abs(np.log(r[on])).max())
        if self.cfg["importance"]["level"] == "sequence":
            r, a, on = self.sequence_ratio(x["logprobs"]), a.sum(axis=1), np.ones(len(a), bool)
        distance = np.abs(np.log(r / self.hi))
        if self.lo > 0:
            distance = np.minimum(distance, np.abs(np.log(r / self.lo)))
        return ClipCounts(
            above=int(((a > 0) & (r > self.hi) & on).sum()),
            below=int(((a < 0) & (r < self.lo) & on).sum()),
            inside=int(((r > self.lo) & (r < self.hi) & on).sum()),
            boundary_distance=float(distance[on].min()),
            max_abs_log_ratio=max_abs_log_ratio,
        )

    def policy_objective(self, logprobs: np.ndarray, frozen_logprobs: np.ndarray | None = None) -> float:
        """The surrogate J (to maximise). `frozen_logprobs`: where CISPO's stop-gradient
        ratio is evaluated (defaults to `logprobs`)."""
        imp, a = self.cfg["importance"], self.adv
        if imp["level"] == "sequence":
            s = self.sequence_ratio(logprobs)[:, None]
            per_token = np.minimum(s * a, np.clip(s, self.lo, self.hi) * a)
        elif imp["clip"] == "mask":
            r = self.token_ratio(logprobs)
            per_token = np.minimum(r * a, np.clip(r, self.lo, self.hi) * a)
        elif imp["clip"] == "truncate":
            frozen = logprobs if frozen_logprobs is None else frozen_logprobs
            r_hat = np.clip(self.token_ratio(frozen), self.lo, self.hi)  # a constant: sg[...]
            per_token = r_hat * a * logprobs
        else:
            per_token = self.token_ratio(logprobs) * a
        return self._agg(self.tis * per_token)

    def regularizers(self, logprobs: np.ndarray, entropy: np.ndarray) -> float:
        """beta * KL - c * H, outside the surrogate (weighted by the aggregation only)."""
        kl = self.cfg["kl"]
        per_token = np.zeros_like(logprobs)
        if kl["coef"] > 0:
            per_token = per_token + kl["coef"] * kl_penalty(kl["estimator"], logprobs, self.x["ref_logprobs"])
        per_token = per_token - self.cfg["entropy_coef"] * entropy
        return self._agg(per_token)

    def value_loss(self, values: np.ndarray) -> float:
        vcfg = self.cfg["value"]
        if vcfg is None:
            return 0.0
        err = (values - self.returns) ** 2
        if vcfg["clip"] is not None:
            old = self.x["old_values"]
            err = np.maximum(
                err, (old + np.clip(values - old, -vcfg["clip"], vcfg["clip"]) - self.returns) ** 2
            )
        return vcfg["coef"] * self._agg(0.5 * err)

    def loss(
        self, logprobs: np.ndarray, entropy: np.ndarray, values: np.ndarray, frozen: np.ndarray | None = None
    ) -> float:
        return (
            -self.policy_objective(logprobs, frozen)
            + self.regularizers(logprobs, entropy)
            + self.value_loss(values)
        )

    def logged_loss(self) -> float:
        """The value the trainer logs. CISPO's `r_hat * A * log pi` is defined for its gradient;
        its logged value is the surrogate per unit of pi, `r_hat * A`, i.e. the same objective
        with `log pi` replaced by the ratio `pi / sg[pi]` (value 1, same gradient)."""
        x = self.x
        if self.cfg["importance"]["clip"] == "truncate" and self.cfg["importance"]["level"] == "token":
            r_hat = np.clip(self.token_ratio(x["logprobs"]), self.lo, self.hi)
            pg = -self._agg(self.tis * r_hat * self.adv)
            return pg + self.regularizers(x["logprobs"], x["entropy"]) + self.value_loss(x["values"])
        return self.loss(x["logprobs"], x["entropy"], x["values"])

    def gradients(self, h: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Central finite differences of `loss` w.r.t. logprobs, entropy and values, [B, T] each."""
        x = self.x
        lp, ent, v = x["logprobs"], x["entropy"], x["values"]
        frozen = lp  # CISPO's sg[r_hat] stays at the evaluation point
        return (
            _central_difference(lambda z: self.loss(z, ent, v, frozen), lp, h),
            _central_difference(lambda z: self.loss(lp, z, v, frozen), ent, h),
            _central_difference(lambda z: self.loss(lp, ent, z, frozen), v, h),
        )


def _central_difference(f: Callable[[np.ndarray], float], at: np.ndarray, h: float) -> np.ndarray:
    grad = np.zeros_like(at)
    for idx in np.ndindex(at.shape):
        up, down = at.copy(), at.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (f(up) - f(down)) / (2 * h)
    return grad
