"""The learner's loss on a later minibatch (the policy has moved away from pi_old) against
the float64 reference: its gradient w.r.t. the parameters must equal the model's
vector-Jacobian product with the reference's finite-difference gradients w.r.t. the
per-token logprobs and entropies. This checks what the learner feeds the objective
(pi_old from the update's start, the frozen reference, entropy, weights) on data where
ratios are not 1 and tokens are clipped, with KL and entropy on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_objective_reference import Reference

import rlax_model
from rlax_trainer import LearnerConfig, preset
from rlax_trainer.learner_passes import UpdateSpec
from rlax_trainer.learner_step import micro_batch_loss
from rlax_trainer.objective import objective_to_dict, prepare_batch

G = 4


def _perturbed(params, seed: int, scale: float):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree,
        [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)],
    )


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


@pytest.fixture(scope="module")
def moved_policy(model_config, model_params, make_batch):
    """A batch, pi_old (the update's start), a frozen reference, and a policy that moved
    away from pi_old (as after a first minibatch), with its logprobs, entropies and VJP."""
    batch = {k: jnp.asarray(v) for k, v in make_batch(21).items()}
    ctx = rlax_model.DenseContext(valid=batch["valid"])

    @jax.jit
    def outputs(params):
        return rlax_model.logprobs(
            params, batch["tokens"], config=model_config, attention_context=ctx, return_entropy=True
        )

    moved = _perturbed(model_params, seed=1, scale=3.0)
    (lp, ent), vjp = jax.vjp(outputs, moved)
    return {
        "batch": batch,
        "old_logprobs": outputs(model_params)[0],
        "ref_logprobs": outputs(_perturbed(model_params, seed=2, scale=0.3))[0],
        "moved": moved,
        "logprobs": lp,
        "entropy": ent,
        "vjp": vjp,
    }


# The two presets whose KL term lost its gradient on clipped tokens; every preset is checked
# at the objective level in test_objective.py.
@pytest.mark.parametrize("name", ["grpo", "reinforce_pp"])
def test_moved_policy_gradient_matches_reference(name, model_config, moved_policy):
    cfg = LearnerConfig(
        objective=preset(name, kl={"coef": 0.05}, entropy_coef=0.01), group_size=G, global_batch=8
    )
    m = moved_policy
    batch = m["batch"]
    prep = prepare_batch(cfg.objective, batch["rewards"], batch["mask"], G)
    mb = dict(
        batch,
        old_logprobs=m["old_logprobs"],
        ref_logprobs=m["ref_logprobs"],
        advantages=prep.advantages,
        weights=prep.weights,
    )
    loss_and_grad = jax.jit(
        jax.value_and_grad(lambda p, mb: micro_batch_loss(UpdateSpec(model_config, cfg), p, mb, 1.0)[0])
    )
    loss, got = loss_and_grad({"policy": m["moved"]}, mb)

    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    shape = m["logprobs"].shape
    x = {
        "mask": f64(batch["mask"]),
        "logprobs": f64(m["logprobs"]),
        "old_logprobs": f64(m["old_logprobs"]),
        "ref_logprobs": f64(m["ref_logprobs"]),
        "infer_logprobs": f64(batch["worker_logprobs"]),
        "entropy": f64(m["entropy"]),
        "values": np.zeros(shape),
        "old_values": np.zeros(shape),
        "rewards": f64(batch["rewards"]),
    }
    ref = Reference(objective_to_dict(cfg.objective), x, G)
    counts = ref.clip_counts()
    assert counts.max_abs_log_ratio > 0.1 and counts.boundary_distance > 1e-5, counts
    assert counts.above > 0 and counts.below > 0, counts
    g_lp, g_ent, _ = ref.gradients()
    (want,) = m["vjp"]((jnp.asarray(g_lp, jnp.float32), jnp.asarray(g_ent, jnp.float32)))
    # The logged loss counts clipped tokens at their clipped surrogate value.
    np.testing.assert_allclose(float(loss), ref.logged_loss(), rtol=1e-5, atol=1e-6)
    got, want = _flat(got["policy"]), _flat(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
