"""RLAX's learner, configured in TRL's GRPO semantics, makes TRL's `GRPOTrainer` update.

The reference is TRL's rule (trl 1.x `GRPOTrainer`: `loss_type="grpo"`, `beta=0`,
`num_iterations=1`, `steps_per_generation` minibatches of one optimizer step each),
written out here in float64 torch on an HF `LlamaForCausalLM` made from the RLAX tiny
model's weights (through RLAX's HF export), independently of `rlax_trainer`:

- advantages `(R - mean_g) / (std_g + 1e-4)`, `std_g` with Bessel's correction;
- pi_old: the policy before the first minibatch, by a forward pass over the whole batch;
- the rows shuffled and dealt into minibatches (`shuffle_sequence_dict`, `split_tensor_dict`);
  the row order is the only thing taken from RLAX (`minibatch_order` with the key the
  update will use), so that both see the same minibatches;
- per token `-min(r A, clip(r, 0.8, 1.2) A)`, `r = exp(logp - logp_old)`; per sequence the
  masked mean over its tokens, then the mean over the minibatch's sequences;
- `torch.nn.utils.clip_grad_norm_`, then `torch.optim.AdamW(betas=(0.9, 0.999), eps=1e-8,
  weight_decay=0)`: one step per minibatch.

HF's Llama computes RMSNorm, RoPE and eager attention's softmax in float32 whatever the
model's dtype: this instance gets float64 versions of the first two and `sdpa` attention,
so the reference is float64 throughout. Its pi_old log-probs are fed to the learner as the
workers' log-probs, so the learner's own `logprob_delta_max` shows that RLAX's float32
pi_old equals the reference's (a mismatch of the update is then not one of the models).

Compared after one whole update (4 minibatches of shuffled rows, the PPO clip acting on
later ones, the gradient clipped on some): the parameter change (cosine and norm ratio),
the mean pre-clip gradient norm, the mean minibatch loss and the clipped-token fraction.
The parameter change alone would be a weak check: Adam's first step is
`lr * g / (|g| + eps)`, about `lr * sign(g)`, blind to the gradient's scale, and later
steps see the scale only through ratios of successive gradients and the clip. Advantages
off by a constant factor (the population std, `ddof=0`: x1.15 for G=4) move the weights
almost the same way (0.35% in norm here) while the gradient norm is 15% off: the last test
shows the gradient norm and the loss catch it. Dealing whole groups into the minibatches
(`minibatch_split="groups"`, not TRL's rule) changes the direction, which the parameter
change catches.
"""

from __future__ import annotations

import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import rlax_model
from rlax_trainer import LearnerConfig, OptimizerConfig, preset
from rlax_trainer.learner import Learner, minibatch_order

NUM_GROUPS, G, MINIBATCHES, SEQ = 4, 4, 4, 16
B = NUM_GROUPS * G
LR, MAX_GRAD_NORM, EPS_CLIP = 1e-2, 3.0, 0.2
SEED = 7

# Tolerances, from measurements (float32 RLAX vs this float64 reference):
# - 1 - cosine of the parameter changes: 1.2e-10 measured (a float32 torch run of the
#   reference is 0.9e-10 from the float64 one);
# - norm ratio - 1: -7.8e-6 measured, nearly all of it optax's float32 bias correction
#   `1 - b2**t` (float32(0.999) is 1.3e-8 off, which that difference amplifies to 1.3e-5 in
#   v_hat: each Adam update is 6.4e-6 to 1e-5 shorter than torch's, which corrects in
#   float64); a float32 torch run of the reference is 8e-8 off;
# - relative error of the mean pre-clip gradient norm 1.2e-6, of the loss 1e-6.
COS_TOL, NORM_TOL, GRAD_NORM_TOL, LOSS_TOL = 1e-8, 3e-5, 1e-5, 1e-5


# ------------------------------------------------------------------ data and configs
def _batch(vocab: int) -> dict[str, np.ndarray]:
    """Right-padded rows: prompts of 2-4 tokens shared by a group, completions of 2-12
    tokens; at least two distinct rewards in every group."""
    rng = np.random.default_rng(3)
    tokens = np.zeros((B, SEQ), np.int32)
    valid = np.zeros((B, SEQ), bool)
    mask = np.zeros((B, SEQ - 1), np.float32)
    prompts = rng.integers(2, 5, size=NUM_GROUPS)
    for i in range(B):
        p = int(prompts[i // G])
        n = int(rng.integers(2, SEQ - p + 1))
        tokens[i, : p + n] = rng.integers(3, vocab, size=p + n)
        if i % G:
            tokens[i, :p] = tokens[i - i % G, :p]
        valid[i, : p + n] = True
        mask[i, p - 1 : p + n - 1] = 1.0  # position t scores token t+1
    rewards = np.round(rng.uniform(0.0, 1.0, size=B), 1).astype(np.float32)
    rewards[::G], rewards[1::G] = 1.0, 0.0
    return {
        "tokens": tokens,
        "valid": valid,
        "mask": mask,
        "rewards": rewards,
        "versions": np.zeros((B,), np.int32),
    }


def _learner_config(*, split: str = "rows", ddof: int = 1) -> LearnerConfig:
    return LearnerConfig(
        objective=preset(
            "grpo",
            advantage={"ddof": ddof, "eps": 1e-4},
            importance={"eps_low": EPS_CLIP, "eps_high": EPS_CLIP},
            kl={"coef": 0.0},
        ),
        group_size=G,
        global_batch=B,
        minibatches=MINIBATCHES,
        minibatch_split=split,
        micro_batch=2,  # accumulating gradients over micro-batches must not change the update
        optimizer=OptimizerConfig(
            lr=LR, schedule="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM
        ),
    )


def _hf_tensors(directory: pathlib.Path, config, params) -> dict[str, np.ndarray]:
    """RLAX params as HF-named float64 arrays (through RLAX's HF export)."""
    rlax_model.save_hf_checkpoint(directory, config, params)
    return {k: v.astype(np.float64) for k, v in load_file(str(directory / "model.safetensors")).items()}


def _flat(tensors: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([tensors[k].ravel() for k in sorted(tensors)])


# ------------------------------------------------------------------ the float64 reference
def _rmsnorm64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _float64_llama(directory: pathlib.Path, rope_theta: float):
    model = transformers.LlamaForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="sdpa"
    )
    for module in model.modules():
        if isinstance(module, transformers.models.llama.modeling_llama.LlamaRMSNorm):
            module.forward = types.MethodType(_rmsnorm64, module)
    head_dim = model.config.head_dim
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def rope64(x, position_ids):
        emb = torch.cat([position_ids[..., None].to(torch.float64) * inv_freq] * 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    model.model.rotary_emb.forward = rope64
    assert all(p.dtype == torch.float64 for p in model.parameters())
    return model


def _torch_logprobs(model, tokens: np.ndarray, valid: np.ndarray):
    """[b, S-1]: log pi(tokens[:, t+1] | tokens[:, :t+1])."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    out = model(input_ids=ids, attention_mask=torch.from_numpy(valid.astype(np.int64)), use_cache=False)
    return torch.log_softmax(out.logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def trl_reference_update(model, batch: dict[str, np.ndarray], order: np.ndarray) -> dict:
    """TRL's GRPO update (see the module docstring) of `model`, in place."""
    mask = torch.from_numpy(batch["mask"].astype(np.float64))
    rewards = torch.from_numpy(batch["rewards"].astype(np.float64)).view(-1, G)
    mean, std = rewards.mean(dim=1, keepdim=True), rewards.std(dim=1, keepdim=True)
    adv = ((rewards - mean) / (std + 1e-4)).reshape(-1, 1)
    with torch.no_grad():
        old = _torch_logprobs(model, batch["tokens"], batch["valid"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rows = B // MINIBATCHES
    grad_norms, losses, clip_fractions = [], [], []
    for m in range(MINIBATCHES):
        idx = order[m * rows : (m + 1) * rows]
        sel = torch.from_numpy(idx.astype(np.int64))
        a, mk = adv[sel], mask[sel]
        logp = _torch_logprobs(model, batch["tokens"][idx], batch["valid"][idx])
        coef_1 = torch.exp(logp - old[sel])
        coef_2 = torch.clamp(coef_1, 1 - EPS_CLIP, 1 + EPS_CLIP)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
        loss = ((per_token * mk).sum(-1) / mk.sum(-1).clamp(min=1.0)).mean()
        opt.zero_grad()
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            hit = ((a > 0) & (coef_1 > 1 + EPS_CLIP)) | ((a < 0) & (coef_1 < 1 - EPS_CLIP))
            clip_fractions.append(float((hit * mk).sum() / mk.sum()))
    return {
        "old_logprobs": old.numpy(),
        "grad_norms": np.array(grad_norms),
        "losses": np.array(losses),
        "clip_fractions": np.array(clip_fractions),
        "tensors": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
    }


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def setup(model_config, tmp_path_factory):
    params = rlax_model.init_params(model_config, jax.random.key(11), std=0.1)
    directory = tmp_path_factory.mktemp("trl_reference")
    before = _hf_tensors(directory / "before", model_config, params)
    return {"params": params, "batch": _batch(model_config.vocab_size), "dir": directory, "before": before}


def _learner(model_config, setup, **variant) -> tuple[Learner, np.ndarray]:
    """A learner and the row order its first update deals the minibatches in: the update
    splits the state's key, the second half orders the rows (`learner_update.batch_update`)."""
    cfg = _learner_config(**variant)
    learner = Learner(model_config, cfg, setup["params"], seed=SEED)
    key = jax.random.split(jax.random.wrap_key_data(jnp.asarray(learner.state.rng)))[1]
    return learner, np.asarray(minibatch_order(key, B, cfg))


@pytest.fixture(scope="module")
def reference(model_config, setup):
    _, order = _learner(model_config, setup)  # TRL's split: the `rows` order
    model = _float64_llama(setup["dir"] / "before", model_config.rope_theta)
    out = trl_reference_update(model, setup["batch"], order)
    out["order"] = order
    assert out["tensors"].keys() == setup["before"].keys()
    out["delta"] = _flat(out["tensors"]) - _flat(setup["before"])
    return out


def _run_rlax(model_config, setup, reference, name: str, **variant) -> dict:
    learner, order = _learner(model_config, setup, **variant)
    # The reference's pi_old as the workers' log-probs: `logprob_delta_*` compares it with
    # the learner's own float32 pi_old pass.
    batch = dict(setup["batch"], worker_logprobs=reference["old_logprobs"].astype(np.float32))
    metrics = learner.update(batch)
    after = _hf_tensors(setup["dir"] / name, model_config, learner.policy_params())
    return {"order": order, "metrics": metrics, "delta": _flat(after) - _flat(setup["before"])}


@pytest.fixture(scope="module")
def rlax_trl(model_config, setup, reference):
    return _run_rlax(model_config, setup, reference, "rlax_trl")


def _figures(run: dict, reference: dict) -> dict[str, float]:
    d, r = run["delta"], reference["delta"]
    m = run["metrics"]
    grad_norm, loss = reference["grad_norms"].mean(), reference["losses"].mean()
    return {
        "1-cos": 1.0 - float(d @ r / (np.linalg.norm(d) * np.linalg.norm(r))),
        "norm_ratio-1": float(np.linalg.norm(d) / np.linalg.norm(r)) - 1.0,
        "grad_norm_rel_err": abs(m["grad_norm"] - grad_norm) / grad_norm,
        "loss_rel_err": abs(m["loss"] - loss) / abs(loss),
    }


def _failed(fig: dict[str, float]) -> list[str]:
    """The criteria of equality with TRL's update that `fig` fails."""
    bad = []
    if not fig["1-cos"] < COS_TOL:
        bad.append("direction")
    if not abs(fig["norm_ratio-1"]) < NORM_TOL:
        bad.append("norm")
    if not fig["grad_norm_rel_err"] < GRAD_NORM_TOL:
        bad.append("grad_norm")
    if not fig["loss_rel_err"] < LOSS_TOL:
        bad.append("loss")
    return bad


def _report(name: str, fig: dict[str, float]) -> str:
    return f"{name}: " + ", ".join(f"{k}={v:.2e}" for k, v in fig.items())


# ------------------------------------------------------------------ tests
def test_rlax_pi_old_equals_float64_hf_logprobs(setup, reference, rlax_trl):
    scored = setup["batch"]["mask"] > 0
    old = reference["old_logprobs"][scored]
    assert old.min() < -3.5 and old.max() > -3.0  # a model with some shape, not uniform (-log 32 = -3.47)
    delta = rlax_trl["metrics"]["logprob_delta_max"]
    print(
        f"max |pi_old RLAX float32 - HF float64| = {delta:.2e} (log-probs {old.min():.2f} .. {old.max():.2f})"
    )
    assert delta < 1e-5


def test_update_matches_trl_reference(setup, rlax_trl, reference):
    fig = _figures(rlax_trl, reference)
    m = rlax_trl["metrics"]
    print(_report("rows/ddof=1 (TRL)", fig), f"|delta_ref|={np.linalg.norm(reference['delta']):.3f}")
    # The setting exercises what it should: the PPO clip acts on later minibatches (ratios
    # moved), the gradient is clipped on some minibatches but not on all (clipping every
    # step by the same rule would cancel in Adam), the weights move by far more than noise.
    assert reference["clip_fractions"][0] == 0.0 and reference["clip_fractions"][1:].min() > 0.05
    assert (reference["grad_norms"] > MAX_GRAD_NORM).any() and (reference["grad_norms"] < MAX_GRAD_NORM).any()
    assert np.linalg.norm(reference["delta"]) > 1.0 and np.linalg.norm(rlax_trl["delta"]) > 1.0
    assert _failed(fig) == [], fig
    # Clipped tokens: RLAX's metric is the minibatches' mean of their token fractions; a
    # ratio within rounding of 1 +- eps may fall either side (one token's worth).
    tokens = setup["batch"]["mask"].sum(1)[rlax_trl["order"]].reshape(MINIBATCHES, -1).sum(1)
    print(f"clip_fraction rlax={m['clip_fraction']:.4f} ref={reference['clip_fractions'].mean():.4f}")
    assert abs(m["clip_fraction"] - reference["clip_fractions"].mean()) <= 1.0 / (MINIBATCHES * tokens.min())


@pytest.fixture(scope="module")
def rlax_groups(model_config, setup, reference):
    return _run_rlax(model_config, setup, reference, "rlax_groups", split="groups")


@pytest.fixture(scope="module")
def rlax_ddof0(model_config, setup, reference):
    return _run_rlax(model_config, setup, reference, "rlax_ddof0", ddof=0)


def test_group_split_is_not_trl_update(rlax_groups, reference):
    """Whole groups per minibatch: another direction, which the parameter change shows."""
    assert not (rlax_groups["order"] == reference["order"]).all()
    fig = _figures(rlax_groups, reference)
    print(_report("groups (not TRL)", fig))
    assert fig["1-cos"] > 1e4 * COS_TOL and abs(fig["norm_ratio-1"]) > 10 * NORM_TOL
    assert {"direction", "norm", "grad_norm", "loss"} <= set(_failed(fig))


def test_population_std_is_not_trl_update(rlax_ddof0, reference):
    """ddof=0 scales every advantage by about sqrt(4/3): the gradient norm and the loss are
    ~15% off, while Adam, nearly blind to a gradient's scale, moves the weights almost
    as TRL does (which is why the gradient norm is compared)."""
    fig = _figures(rlax_ddof0, reference)
    print(_report("ddof=0 (not TRL)", fig))
    assert fig["grad_norm_rel_err"] > 0.1 and fig["loss_rel_err"] > 0.1
    assert abs(fig["norm_ratio-1"]) < 0.02  # the parameter change alone hardly shows it ...
    assert {"direction", "norm"} <= set(_failed(fig))  # ... though still beyond the tolerances
