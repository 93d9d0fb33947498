"""One minibatch's optimizer step: the objective of its micro-batches (or packed rows), the
gradient accumulated over them, their metrics merged, and one optax step on the float32
master weights. Traced inside the jitted update (`rlax_trainer.learner_update`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlax_trainer.config import LearnerConfig, make_optimizer
from rlax_trainer.learner_passes import (
    PACKED_ROW_FIELDS,
    UpdateSpec,
    packed_outputs,
    policy_outputs,
    with_base,
)
from rlax_trainer.objective import objective_loss

__all__ = ["micro_batch_loss", "micro_view", "minibatch_step", "packed_minibatch_step"]

# (params, optax state): the carry of the minibatch scan. Pytrees, and optax is untyped.
StepCarry = tuple[Any, Any]
# (metrics, the pass's log-probs without gradient): the auxiliary output of a loss.
LossAux = tuple[dict[str, jax.Array], jax.Array]

sg = jax.lax.stop_gradient
_SUMMED = ("loss", "pg_loss", "regularizer_loss", "value_loss", "nll")
_ROW_MEANS = ("behav_corrected_seq_fraction",)  # per-row means: micro-batches have equal rows


def micro_view(x: jax.Array, n_micro: int) -> jax.Array:
    """x [rows, ...] -> [n_micro, rows / n_micro, ...]: micro-batch i holds rows i, i + n_micro, ..."""
    # Strided micro-batches (row r goes to micro-batch r % n_micro) keep each device's rows
    # on that device when the row axis is sharded; per-row weights make the split exact.
    return x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)


def micro_batch_loss(
    spec: UpdateSpec, params: Any, mb: dict[str, jax.Array], scale: float, base: Any = None
) -> tuple[jax.Array, LossAux]:
    """(loss * scale, (metrics, this pass's log-probs without gradient [rows, T-1])).
    base: the frozen base under `lora` (`with_base`), else None."""
    full = with_base(spec, params, base)
    lp, ent, values = policy_outputs(spec, full, mb["tokens"], mb["valid"], mb["mask"] > 0)
    return _objective(spec, mb, mb["mask"], mb["weights"], lp, ent, values, scale)


def _objective(
    spec: UpdateSpec,
    mb: dict[str, jax.Array],
    mask: jax.Array,
    weights: jax.Array,
    lp: jax.Array,
    ent: jax.Array,
    values: jax.Array | None,
    scale: float,
) -> tuple[jax.Array, LossAux]:
    """The objective of the rollouts in `mb` whose tokens `mask` [rows, T-1] keeps, from the
    policy's outputs on them -> (loss * scale, (metrics, `lp` without gradient))."""
    if spec.config.mode == "sft":
        nll = -(weights * lp).sum()
        return nll * scale, (
            {"nll": nll, "entropy": (ent * mask).sum() / jnp.maximum(mask.sum(), 1.0)},
            sg(lp),
        )
    assert spec.config.objective is not None  # LearnerConfig requires one for mode="rl"
    loss, metrics = objective_loss(
        spec.config.objective,
        logprobs=lp,
        # Without a separate pi_old pass (`learner_update._reuses_policy_pass`) the policy these params
        # define is pi_old: its log-probs, without gradient (ratio 1, as TRL does).
        old_logprobs=mb["old_logprobs"] if "old_logprobs" in mb else sg(lp),
        advantages=mb["advantages"],
        weights=weights,
        mask=mask,
        ref_logprobs=mb.get("ref_logprobs"),
        infer_logprobs=mb["worker_logprobs"],
        sampler_old_logprobs=mb.get("sampler_old_logprobs"),
        entropy=ent,
        values=values,
        old_values=mb.get("old_values"),
        returns=mb.get("returns"),
    )
    return loss * scale, (metrics, sg(lp))


def _packed_loss(
    spec: UpdateSpec,
    params: Any,
    row: dict[str, jax.Array],
    j: jax.Array,
    mb: dict[str, jax.Array],
    scale: float,
    base: Any = None,
) -> tuple[jax.Array, LossAux]:
    """The objective of the rollouts packed in row j of minibatch `mb` (its padded-layout
    arrays and `pk_seq_row`/`pk_source`): the other rollouts are masked out, so the sum over
    the rows used is the minibatch's objective (every built-in loss adds up over rollouts)."""
    here = (mb["pk_seq_row"] == j)[:, None]
    mask = mb["mask"] * here
    full = with_base(spec, params, base)
    lp, ent, values, _ = packed_outputs(spec, full, row, mb["pk_source"], mb["tokens"][:, 1:], mask > 0)
    return _objective(spec, mb, mask, mb["weights"] * here, lp, ent, values, scale)


def _merge_metrics(
    cfg: LearnerConfig, metrics: dict[str, jax.Array], tokens: jax.Array, ran: jax.Array | None
) -> dict[str, jax.Array]:
    """Per-pass metrics [passes] -> one value each; `ran` [passes] bool marks passes that ran
    (None: all); `tokens` [passes]: response tokens per pass (the weights of token means)."""
    merged: dict[str, jax.Array] = {}
    for k, v in metrics.items():
        if k in _SUMMED:
            # Weights were normalised over the whole batch: rescale to this minibatch's share.
            merged[k] = v.sum() * cfg.minibatches
        elif k in _ROW_MEANS:
            # Packed passes see every row of the minibatch, the others masked: their
            # fractions add up; micro-batches hold equal row counts: theirs average.
            merged[k] = v.mean() if ran is None else v.sum()
        elif k.endswith("_max"):
            merged[k] = v.max() if ran is None else jnp.where(ran, v, -jnp.inf).max()
        elif k.endswith("_min"):
            merged[k] = v.min() if ran is None else jnp.where(ran, v, jnp.inf).min()
        else:
            merged[k] = (v * tokens).sum() / jnp.maximum(tokens.sum(), 1.0)
    return merged


def packed_minibatch_step(
    spec: UpdateSpec, carry: StepCarry, mb: dict[str, jax.Array], *, base: Any = None
) -> tuple[StepCarry, dict[str, jax.Array]]:
    """`minibatch_step` over packed rows: one forward/backward pass per row used."""
    params, opt_state = carry
    cfg = spec.config
    b = mb["tokens"].shape[0]
    loss = functools.partial(_packed_loss, spec, scale=float(cfg.minibatches), base=base)
    grad_fn = jax.grad(loss, has_aux=True)

    def row(j: jax.Array | int) -> dict[str, jax.Array]:
        return {k: mb[f"pk_{k}"][j] for k in PACKED_ROW_FIELDS}

    if mb["pk_tokens"].shape[0] == 1:  # one row holds the minibatch: one pass, no accumulator
        grads, (metrics, logprobs) = grad_fn(params, row(0), jnp.int32(0), mb)
        merged = _merge_metrics(cfg, jax.tree.map(lambda v: v[None], metrics), mb["mask"].sum()[None], None)
        return _apply_gradients(cfg, params, opt_state, grads, merged, logprobs)

    metric_shapes = jax.eval_shape(lambda: grad_fn(params, row(0), jnp.int32(0), mb)[1][0])
    init = (
        jnp.int32(0),
        jax.tree.map(jnp.zeros_like, params),
        {k: jnp.zeros((b,), v.dtype) for k, v in metric_shapes.items()},
        jnp.zeros((b,), jnp.float32),
        jnp.zeros(mb["mask"].shape, jnp.float32),
    )

    def body(
        state: tuple[jax.Array, Any, dict[str, jax.Array], jax.Array, jax.Array],
    ) -> tuple[jax.Array, Any, dict[str, jax.Array], jax.Array, jax.Array]:
        j, acc, metrics, tokens, logprobs = state
        grads, (m, lp) = grad_fn(params, row(j), j, mb)
        here = mb["pk_seq_row"] == j
        metrics = {k: metrics[k].at[j].set(v) for k, v in m.items()}
        tokens = tokens.at[j].set((mb["mask"] * here[:, None]).sum())
        logprobs = jnp.where(here[:, None], lp, logprobs)
        return j + 1, jax.tree.map(jnp.add, acc, grads), metrics, tokens, logprobs

    _, grads, metrics, tokens, logprobs = jax.lax.while_loop(lambda s: s[0] < mb["pk_rows_used"], body, init)
    merged = _merge_metrics(cfg, metrics, tokens, jnp.arange(b) < mb["pk_rows_used"])
    return _apply_gradients(cfg, params, opt_state, grads, merged, logprobs)


def _apply_gradients(
    cfg: LearnerConfig,
    params: Any,
    opt_state: Any,
    grads: Any,
    merged: dict[str, jax.Array],
    logprobs: jax.Array,
) -> tuple[StepCarry, dict[str, jax.Array]]:
    """One optax step; -> ((params, opt_state), metrics with `grad_norm` and the pass's `logprobs`)."""
    merged["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = make_optimizer(cfg.optimizer).update(grads, opt_state, params)
    merged["logprobs"] = logprobs
    return (optax.apply_updates(params, updates), opt_state), merged


def minibatch_step(
    spec: UpdateSpec, carry: StepCarry, mb: dict[str, jax.Array], *, base: Any = None
) -> tuple[StepCarry, dict[str, jax.Array]]:
    """One optimizer step over a minibatch, in micro-batches (gradients accumulated).
    base: the frozen base under `lora` (the carry's params are then the adapters)."""
    params, opt_state = carry
    cfg = spec.config
    n_micro = mb["tokens"].shape[0] // cfg.micro
    micro = jax.tree.map(lambda x: micro_view(x, n_micro), mb)
    loss = functools.partial(micro_batch_loss, spec, scale=float(cfg.minibatches), base=base)
    grad_fn = jax.grad(loss, has_aux=True)

    def body(
        acc: Any, xs: dict[str, jax.Array]
    ) -> tuple[Any, tuple[dict[str, jax.Array], jax.Array, jax.Array]]:
        grads, (metrics, lp) = grad_fn(params, xs)
        tokens = xs["mask"].sum()
        return jax.tree.map(jnp.add, acc, grads), (metrics, tokens, lp)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (metrics, tokens, lp) = jax.lax.scan(body, zeros, micro)
    merged = _merge_metrics(cfg, metrics, tokens, None)
    rows = mb["tokens"].shape[0]
    logprobs = lp.swapaxes(0, 1).reshape(rows, *lp.shape[2:])  # back from the micro view
    return _apply_gradients(cfg, params, opt_state, grads, merged, logprobs)
