"""The jitted update from one padded rollout batch.

Inside one `jax.jit`: (1) the trainer's own forward pass recomputes pi_old logprobs
(and values, and reference logprobs) over micro-batches; the workers' logprobs are used
only for mismatch metrics and the off-policy correction (when the sampler truncates with
top-p/top-k, against pi_old recomputed on the same truncated support: `sampler_logprobs`);
(2) advantages and aggregation weights are formed on the whole batch; (3) the batch is
dealt into minibatches (rows shuffled across the batch, or whole groups:
`LearnerConfig.minibatch_split`); for each minibatch, gradients are accumulated over
micro-batches and one optax step is applied to the float32 master weights
(`rlax_trainer.learner_step`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import rlax_model
from rlax_model.logprobs import head_logprobs
from rlax_trainer.config import LearnerConfig, learning_rate_schedule
from rlax_trainer.learner_passes import (
    PACKED_ROW_FIELDS,
    UpdateSpec,
    compute_dtype,
    invariant_rows,
    logprob_chunk_size,
    packed_hidden,
    packed_outputs,
    policy_outputs,
    reference_logprobs,
    sampler_logprobs_of_hidden,
    sampler_old_logprobs,
    with_base,
)
from rlax_trainer.learner_step import micro_view, minibatch_step, packed_minibatch_step
from rlax_trainer.objective import prepare_batch

__all__ = [
    "FrozenParams",
    "TrainState",
    "batch_update",
    "batch_update_jit",
    "batch_update_jit_aligned",
    "minibatch_order",
]

sg = jax.lax.stop_gradient


class TrainState(NamedTuple):
    """params: {"policy": model params, optionally "value": {"w": [H], "b": []}}, float32
    masters; under `lora`, {"lora": `rlax_model.lora.Adapters`, ...} in place of "policy"."""

    params: Any
    opt_state: Any
    # Any: jax.Array in a state; `Learner._state_sh` holds the state's shardings in one.
    step: Any  # int32 scalar: completed updates (= published weight version)
    rng: Any  # uint32 [2] raw PRNG key data, splits once per update


def _masked_quantiles(x: jax.Array, mask: jax.Array, qs: tuple[float, ...]) -> jax.Array:
    return jnp.nanquantile(jnp.where(mask > 0, x, jnp.nan), jnp.array(qs))


def _spread(prefix: str, x: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """`{prefix}_p50`, `_p95` and `_max` of `x` where `mask` > 0 (all 0 when nothing is)."""
    q = jnp.where(mask.sum() > 0, _masked_quantiles(x, mask, (0.5, 0.95)), 0.0)
    return {f"{prefix}_p50": q[0], f"{prefix}_p95": q[1], f"{prefix}_max": jnp.where(mask > 0, x, 0.0).max()}


def _stats(prefix: str, x: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    n = jnp.maximum(mask.sum(), 1.0)
    mean = (x * mask).sum() / n
    big = jnp.float32(3e38)
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_std": jnp.sqrt((((x - mean) * mask) ** 2).sum() / n),
        f"{prefix}_max": jnp.where(mask > 0, x, -big).max(),
        f"{prefix}_min": jnp.where(mask > 0, x, big).min(),
    }


def _packed_old_outputs(
    spec: UpdateSpec, params: Any, ref: Any, mb: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """pi_old (and values, reference and sampler-support log-probs) of one packed minibatch,
    without gradient: the same passes as the update's, so on-policy ratios are exactly 1."""
    cfg = spec.config
    targets, scored = mb["tokens"][:, 1:], mb["mask"] > 0

    def outputs(j: jax.Array) -> dict[str, jax.Array]:
        row = {k: mb[f"pk_{k}"][j] for k in PACKED_ROW_FIELDS}
        here = scored & (mb["pk_seq_row"] == j)[:, None]
        lp, ent, values, hidden = packed_outputs(
            spec, sg(params), row, mb["pk_source"], targets, here, remat=False
        )
        out = {"old_logprobs": lp, "old_entropy": ent}
        if values is not None:
            out["old_values"] = values
        if cfg.mode == "rl" and cfg.truncated_sampling:  # the same hidden states, another support
            policy = jax.tree.map(lambda x: x.astype(compute_dtype(cfg)), sg(params)["policy"])
            out["sampler_old_logprobs"] = sampler_logprobs_of_hidden(spec, policy, hidden, targets)
        if ref is not None:
            ref_hidden = packed_hidden(spec, ref, row, remat=False)[mb["pk_source"]]
            w = rlax_model.lm_head_weight(ref, spec.model).astype(ref_hidden.dtype)
            out["ref_logprobs"] = head_logprobs(
                ref_hidden, targets, w, temperature=cfg.temperature, chunk_size=logprob_chunk_size(spec, targets),
                scored=here,
            )[0]  # fmt: skip
        return out

    shapes = jax.eval_shape(lambda: outputs(jnp.int32(0)))
    init = (jnp.int32(0), {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()})

    def body(state: tuple[jax.Array, dict[str, jax.Array]]) -> tuple[jax.Array, dict[str, jax.Array]]:
        j, acc = state
        here = (mb["pk_seq_row"] == j)[:, None]
        return j + 1, {k: jnp.where(here, v, acc[k]) for k, v in outputs(j).items()}

    old: dict[str, jax.Array] = jax.lax.while_loop(lambda s: s[0] < mb["pk_rows_used"], body, init)[1]
    return old


def minibatch_order(key: jax.Array, rows: int, cfg: LearnerConfig) -> jax.Array:
    """-> [rows] int32: the batch's row order; minibatch m takes rows m*rows/M .. (m+1)*rows/M.

    One minibatch keeps batch order (its gradient pass then doubles as pi_old's). `rows`:
    a seeded permutation of all rollouts (TRL's shuffle-then-split). `groups`: a permutation
    of whole groups (the G samples of a prompt stay together, in order)."""
    if cfg.minibatches == 1:
        return jnp.arange(rows)
    if cfg.minibatch_split == "rows":
        return jax.random.permutation(key, rows)
    groups = jax.random.permutation(key, rows // cfg.group_size)
    return (groups[:, None] * cfg.group_size + jnp.arange(cfg.group_size)[None, :]).reshape(-1)


def _reuses_policy_pass(spec: UpdateSpec, has_values: bool, has_ref: bool) -> bool:
    """True when pi_old equals the policy of the (only) optimizer step: one minibatch, so the
    gradient pass's own log-probs (without gradient) are pi_old's, and the separate forward
    pass over the batch can be skipped (it costs a fifth of the update with remat). A value
    head (its old values shape the advantages) or a reference model keep the pass."""
    cfg = spec.config
    return cfg.mode == "rl" and cfg.minibatches == 1 and not has_values and not has_ref


class FrozenParams(NamedTuple):
    """What an update reads and never trains: the KL reference's params (None without a KL
    term) and, under `lora`, the base the adapters sit on (None otherwise; with both, the
    reference is the base: the same arrays)."""

    reference: Any
    base: Any


@invariant_rows
def batch_update(
    spec: UpdateSpec, state: TrainState, frozen: FrozenParams, batch: dict[str, jax.Array]
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One update -> (the next TrainState, metrics {name: scalar}).

    frozen: `FrozenParams`. batch: tokens, valid [B, S]; mask,
    worker_logprobs, token_rewards, turn_ends [B, S-1]; rewards, versions [B]; when
    packed, also the host's row
    `order` [B] and the packing's `pk_*` arrays ([minibatches, ...])."""
    cfg = spec.config
    ref, base = frozen
    b = batch["tokens"].shape[0]
    mask = batch["mask"]
    n_micro_all = b // cfg.micro
    current = with_base(spec, sg(state.params), base)  # the policy before the update

    # (1) pi_old (and values, reference) by the trainer's own forward pass, no gradient.
    def old_body(_: None, xs: dict[str, jax.Array]) -> tuple[None, dict[str, jax.Array]]:
        scored = xs["mask"] > 0
        lp, ent, values = policy_outputs(spec, current, xs["tokens"], xs["valid"], scored, remat=False)
        out = {"old_logprobs": lp, "old_entropy": ent}
        if values is not None:
            out["old_values"] = values
        if ref is not None:
            out["ref_logprobs"] = reference_logprobs(spec, ref, xs["tokens"], xs["valid"], scored)
        if cfg.mode == "rl" and cfg.truncated_sampling:
            out["sampler_old_logprobs"] = sampler_old_logprobs(spec, current, xs["tokens"], xs["valid"])
        return None, out

    reuse = _reuses_policy_pass(spec, has_values="value" in state.params, has_ref=ref is not None)
    # Packed (`rlax_trainer.packing`): the host dealt the rows into minibatches (`order`,
    # from the same key as below) and packed each; the `pk_` arrays are [minibatches, ...].
    packed = "pk_rows_used" in batch
    rng, sub = jax.random.split(jax.random.wrap_key_data(state.rng))
    row_order = batch["order"] if packed else minibatch_order(sub, b, cfg)

    def deal(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Batch-order rows -> [minibatches, rows, ...] in `row_order`, with the packing."""
        out: dict[str, jax.Array] = jax.tree.map(
            lambda x: x[row_order].reshape(cfg.minibatches, b // cfg.minibatches, *x.shape[1:]), arrays
        )
        if packed:
            out.update({k: v for k, v in batch.items() if k.startswith("pk_")})
        return out

    old: dict[str, jax.Array] = {}
    if not reuse and packed:
        dealt = deal({k: batch[k] for k in ("tokens", "mask")})
        old = jax.lax.map(lambda mb: _packed_old_outputs(spec, current, ref, mb), dealt)
        back = jnp.argsort(row_order)  # minibatch order -> batch order
        old = jax.tree.map(lambda x: x.reshape(b, *x.shape[2:])[back], old)
    elif not reuse:
        view = {k: micro_view(batch[k], n_micro_all) for k in ("tokens", "valid", "mask")}
        _, old = jax.lax.scan(old_body, None, view)
        old = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(b, *x.shape[2:]), old)

    rows = {k: batch[k] for k in ("tokens", "valid", "mask", "worker_logprobs")}
    rows.update({k: v for k, v in old.items() if k != "old_entropy"})
    metrics: dict[str, jax.Array] = {}
    if cfg.mode == "rl":
        assert cfg.objective is not None  # LearnerConfig requires one for mode="rl"
        prep = prepare_batch(
            cfg.objective,
            batch["rewards"],
            mask,
            cfg.group_size,
            old.get("old_values"),
            token_rewards=batch["token_rewards"],
            turn_ends=batch["turn_ends"],
        )
        rows["advantages"], rows["weights"] = prep.advantages, prep.weights
        if prep.returns is not None:
            rows["returns"] = prep.returns
        seq_adv = (prep.advantages * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)
        metrics.update(_stats("advantage", seq_adv, jnp.ones_like(seq_adv)))
        metrics.update(_stats("reward", batch["rewards"], jnp.ones_like(batch["rewards"])))
    else:
        rows["weights"] = mask / jnp.maximum(mask.sum(), 1.0)

    def logprob_metrics(old_logprobs: jax.Array) -> None:
        delta = jnp.abs(old_logprobs - batch["worker_logprobs"])
        metrics.update(_spread("logprob_delta", delta, mask))
        # The same on rollouts made by the very weights this update starts from: pure
        # engine-vs-trainer numerical mismatch, without staleness (0 when there are none).
        on_policy = mask * (batch["versions"] == state.step)[:, None]
        metrics.update(_spread("logprob_mismatch", delta, on_policy))
        metrics["on_policy_tokens"] = on_policy.sum()

    if not reuse:
        # On the sampler's support when it truncates: what the workers' logprobs are on.
        logprob_metrics(old.get("sampler_old_logprobs", old["old_logprobs"]))
    lengths = mask.sum(1)
    metrics.update(_stats("response_length", lengths, jnp.ones_like(lengths)))

    # (2) minibatches: rows (or whole groups) shuffled with the state's key.
    step_fn = packed_minibatch_step if packed else minibatch_step
    (params, opt_state), mb_metrics = jax.lax.scan(
        functools.partial(step_fn, spec, base=base), (state.params, state.opt_state), deal(rows)
    )
    pass_logprobs = mb_metrics.pop("logprobs")  # [minibatches, rows, T-1]
    if reuse:  # one minibatch in batch order: the gradient pass's log-probs are pi_old's
        logprob_metrics(pass_logprobs[0])
    for k, v in mb_metrics.items():
        metrics[k] = v.max() if k.endswith("_max") else v.min() if k.endswith("_min") else v.mean()
    metrics["learning_rate"] = jnp.asarray(
        learning_rate_schedule(cfg.optimizer)(state.step * cfg.minibatches), jnp.float32
    )
    new_state = TrainState(params, opt_state, state.step + 1, jax.random.key_data(rng))
    return new_state, metrics


batch_update_jit = jax.jit(batch_update, static_argnums=(0,), donate_argnums=(1,))
# `batch_invariant`'s update: the compiler options of the engine's aligned mode, so that the
# trainer's log-probs are bitwise those of `rlax_inference.EngineConfig(aligned=True)`.
batch_update_jit_aligned = jax.jit(
    batch_update,
    static_argnums=(0,),
    donate_argnums=(1,),
    compiler_options=rlax_model.layers.ALIGNED_COMPILER_OPTIONS,
)
