"""The learner: one jitted update from a padded rollout batch.

Inside one `jax.jit`: (1) the trainer's own forward pass recomputes pi_old logprobs
(and values, and reference logprobs) over micro-batches; the workers' logprobs are used
only for mismatch metrics and the off-policy correction (when the sampler truncates with
top-p/top-k, against pi_old recomputed on the same truncated support: `sampler_logprobs`); (2) advantages and aggregation weights are formed on
the whole batch; (3) the batch is dealt into minibatches (rows shuffled across the batch,
or whole groups: `LearnerConfig.minibatch_split`); for each minibatch, gradients are accumulated over micro-batches
and one optax step is applied to the float32 master weights.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import rlax_model
from rlax_model.logprobs import head_logprobs
from rlax_trainer.buffer import RolloutBatch
from rlax_trainer.config import LearnerConfig, make_optimizer
from rlax_trainer.config import learning_rate_schedule as _lr_schedule
from rlax_trainer.memory import peak_memory_metrics, release_free_memory
from rlax_trainer.objective import objective_loss, prepare_batch
from rlax_trainer.packing import best_layout, candidate_lengths
from rlax_trainer.padding import trim_to_bucket
from rlax_trainer.sharding import batch_sharding, param_sharding, put_global, replicated, to_host

__all__ = ["Learner", "TrainState", "batch_arrays", "minibatch_order", "sampler_logprobs"]

sg = jax.lax.stop_gradient
_SUMMED = ("loss", "pg_loss", "regularizer_loss", "value_loss", "nll")
_ROW_MEANS = ("behav_corrected_seq_fraction",)  # per-row means: micro-batches have equal rows


class TrainState(NamedTuple):
    """params: {"policy": model params, optionally "value": {"w": [H], "b": []}}, float32 masters."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: completed updates (= published weight version)
    rng: jax.Array  # uint32 [2] raw PRNG key data, splits once per update


def batch_arrays(batch: RolloutBatch) -> dict[str, np.ndarray]:
    """The arrays of a RolloutBatch that the jitted update reads."""
    return {
        "tokens": batch.tokens.astype(np.int32),
        "valid": batch.valid.astype(bool),
        "mask": batch.mask.astype(np.float32),
        "worker_logprobs": batch.worker_logprobs.astype(np.float32),
        "rewards": batch.rewards.astype(np.float32),
        "versions": batch.versions.astype(np.int32),
    }


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


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Hashable static description of the update: equal specs share one compiled program."""

    model: rlax_model.ModelConfig
    config: LearnerConfig


# ------------------------------------------------------------------ model passes
def _dtype(cfg: LearnerConfig) -> jnp.dtype:
    """The forward pass's parameter dtype after `rlax_model.dtype_policy` (float32 for bfloat16 on a CPU)."""
    return jnp.bfloat16 if rlax_model.resolve_dtypes(cfg.param_dtype)[0] == "bfloat16" else jnp.float32


# Below this many logits elements ([rows, S-1, V] of one micro-batch, 16 MB in float32) the
# vocabulary projection runs dense: chunking only saves memory, and on a small vocabulary
# its scan, gather and recomputation cost more than the projection (the demo's update took
# 0.19 s chunked, 0.11 s dense).
DENSE_LOGITS_ELEMENTS = 1 << 22


def _invariant_rows(fn: Any) -> Any:
    """Trace `fn(spec, ...)` with one-row matmuls padded to `ALIGNED_MIN_ROWS` rows when the
    config asks for batch invariance (the spec is static: each setting compiles apart); the
    update then compiles with `ALIGNED_COMPILER_OPTIONS`, whose matmuls round a row alike
    for any row count from 2 on (XLA:CPU's default rounded rows of up to 32 otherwise, and
    needed them padded to `MIN_MATMUL_ROWS`)."""

    @functools.wraps(fn)
    def traced(spec: _Spec, *args: Any, **kwargs: Any) -> Any:
        rows = rlax_model.layers.ALIGNED_MIN_ROWS if spec.config.batch_invariant else 0
        with rlax_model.layers.padded_matmul_rows(rows):
            return fn(spec, *args, **kwargs)

    return traced


def _attention(spec: _Spec) -> Any:
    """The passes' attention function: blocked (batch-invariant) when the config asks for it,
    else None (the model's default)."""
    if not spec.config.batch_invariant:
        return None
    return functools.partial(
        rlax_model.dense_causal_attention,
        sliding_window=spec.model.sliding_window,
        key_block=rlax_model.attention.KEY_BLOCK,
    )


def _chunk_size(spec: _Spec, tokens: jax.Array) -> int | None:
    """`logprob_chunk_size`, or None (dense) when the micro-batch's full logits are small."""
    rows, seq = tokens.shape
    if rows * (seq - 1) * spec.model.vocab_size <= DENSE_LOGITS_ELEMENTS:
        return None
    return spec.config.logprob_chunk_size


@_invariant_rows
def _policy_outputs(
    spec: _Spec, params: Any, tokens: jax.Array, valid: jax.Array, scored: jax.Array, *, remat: bool = True
):
    """-> logprobs [b, S-1] f32, entropy [b, S-1] f32, values [b, S-1] f32 or None; the
    log-probs and entropies only where `scored` [b, S-1] (the loss mask), 0 elsewhere."""
    cfg, mc = spec.config, spec.model
    policy = jax.tree.map(lambda x: x.astype(_dtype(cfg)), params["policy"])
    ctx = rlax_model.DenseContext(valid=valid)
    remat_mode = None if (cfg.remat == "none" or not remat) else cfg.remat
    if "value" not in params:
        lp, ent = rlax_model.logprobs(
            policy,
            tokens,
            config=mc,
            attention=_attention(spec),
            attention_context=ctx,
            temperature=cfg.temperature,
            return_entropy=True,
            remat=remat_mode,
            chunk_size=_chunk_size(spec, tokens),
            scored=scored,
        )
        return lp, ent, None
    positions = rlax_model.positions_from_valid(valid)
    hidden, _ = rlax_model.hidden_states(
        policy,
        tokens,
        positions,
        config=mc,
        attention=_attention(spec),
        attention_context=ctx,
        remat=remat_mode,
    )
    hidden = hidden[:, :-1]
    w = rlax_model.lm_head_weight(policy, mc).astype(hidden.dtype)
    lp, ent = head_logprobs(
        hidden,
        tokens[:, 1:],
        w,
        temperature=cfg.temperature,
        chunk_size=_chunk_size(spec, tokens),
        scored=scored,
    )
    values = hidden.astype(jnp.float32) @ params["value"]["w"] + params["value"]["b"]
    return lp, ent, values


def sampler_logprobs(
    logits: jax.Array, targets: jax.Array, *, temperature: float, top_p: float, top_k: int
) -> jax.Array:
    """Log-prob of each target under the distribution the engine's sampler draws from
    (`rlax_inference.sampler.filtered_logits`): softmax(logits / T) restricted to the top-k,
    then to the smallest most-likely set whose probability (renormalised after top-k)
    reaches top-p, the most likely token always kept, renormalised; ties in the order a
    stable descending sort gives. A target outside the kept set gets -inf.

    logits: [n, V] float32; targets: [n] int -> [n] float32.
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / temperature
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_vals = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)
    keep = jnp.broadcast_to((top_k <= 0) | (rank < top_k), sorted_vals.shape)
    sorted_vals = jnp.where(keep, sorted_vals, -jnp.inf)
    probs = jax.nn.softmax(sorted_vals, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & ((before < top_p) | (rank == 0))
    kept = jnp.where(keep, sorted_vals, -jnp.inf)
    log_norm = jax.nn.logsumexp(kept, axis=-1)
    # The target's rank: where it sits in `order`.
    pos = jnp.argmax(order == targets[:, None], axis=-1)
    return jnp.take_along_axis(kept, pos[:, None], axis=-1)[:, 0] - log_norm


@_invariant_rows
def _sampler_old_logprobs(spec: _Spec, params: Any, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """pi_old's log-probs [b, S-1] on the sampler's top-p/top-k support (see `sampler_logprobs`),
    over chunks of `logprob_chunk_size` tokens (a [chunk, V] sort each); no gradient."""
    cfg, mc = spec.config, spec.model
    policy = jax.tree.map(lambda x: x.astype(_dtype(cfg)), params["policy"])
    ctx = rlax_model.DenseContext(valid=valid)
    positions = rlax_model.positions_from_valid(valid)
    hidden, _ = rlax_model.hidden_states(
        policy, tokens, positions, config=mc, attention=_attention(spec), attention_context=ctx
    )
    return _sampler_logprobs_of_hidden(spec, policy, hidden[:, :-1], tokens[:, 1:])


def _sampler_logprobs_of_hidden(spec: _Spec, policy: Any, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """hidden [b, T, H] (the states predicting `targets` [b, T]) -> sampler-support log-probs [b, T]."""
    cfg, mc = spec.config, spec.model
    lead = targets.shape
    hid = hidden.reshape(-1, hidden.shape[-1])
    tgt = targets.reshape(-1)
    total = tgt.shape[0]
    chunk = min(cfg.logprob_chunk_size or total, total)
    n = -(-total // chunk)
    pad = n * chunk - total
    hid = jnp.pad(hid, ((0, pad), (0, 0))).reshape(n, chunk, hid.shape[-1])
    tgt = jnp.pad(tgt, (0, pad)).reshape(n, chunk)
    w = rlax_model.lm_head_weight(policy, mc).astype(hid.dtype)

    def one(xs):
        logits = jnp.einsum("nh,hv->nv", xs[0], w, preferred_element_type=jnp.float32)
        return sampler_logprobs(logits, xs[1], temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)

    return jax.lax.map(one, (hid, tgt)).reshape(-1)[:total].reshape(lead)


@_invariant_rows
def _reference_logprobs(
    spec: _Spec, ref: Any, tokens: jax.Array, valid: jax.Array, scored: jax.Array
) -> jax.Array:
    ctx = rlax_model.DenseContext(valid=valid)
    return rlax_model.logprobs(
        ref,
        tokens,
        config=spec.model,
        attention=_attention(spec),
        attention_context=ctx,
        temperature=spec.config.temperature,
        chunk_size=_chunk_size(spec, tokens),
        scored=scored,
    )


# ------------------------------------------------------------------ the update
def _micro_view(x: jax.Array, n_micro: int) -> jax.Array:
    # Strided micro-batches (row r goes to micro-batch r % n_micro) keep each device's rows
    # on that device when the row axis is sharded; per-row weights make the split exact.
    return x.reshape(x.shape[0] // n_micro, n_micro, *x.shape[1:]).swapaxes(0, 1)


def _loss(spec: _Spec, params: Any, mb: dict[str, jax.Array], scale: float):
    """(loss * scale, (metrics, this pass's log-probs without gradient [rows, T-1]))."""
    lp, ent, values = _policy_outputs(spec, params, mb["tokens"], mb["valid"], mb["mask"] > 0)
    return _objective(spec, mb, mb["mask"], mb["weights"], lp, ent, values, scale)


def _objective(
    spec: _Spec,
    mb: dict[str, jax.Array],
    mask: jax.Array,
    weights: jax.Array,
    lp: jax.Array,
    ent: jax.Array,
    values: jax.Array | None,
    scale: float,
):
    """The objective of the rollouts in `mb` whose tokens `mask` [rows, T-1] keeps, from the
    policy's outputs on them -> (loss * scale, (metrics, `lp` without gradient))."""
    if spec.config.mode == "sft":
        nll = -(weights * lp).sum()
        return nll * scale, (
            {"nll": nll, "entropy": (ent * mask).sum() / jnp.maximum(mask.sum(), 1.0)},
            sg(lp),
        )
    loss, metrics = objective_loss(
        spec.config.objective,
        logprobs=lp,
        # Without a separate pi_old pass (_reuses_policy_pass) the policy these params
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


# ------------------------------------------------------------------ packed passes
_ROW_FIELDS = ("tokens", "segment", "parent", "positions")


def _packed_hidden(spec: _Spec, params: Any, row: dict[str, jax.Array], *, remat: bool) -> jax.Array:
    """One packed row (`rlax_trainer.packing`: tokens/segment/parent/positions [L]) through the
    decoder -> hidden [L, H] in the compute dtype."""
    cfg = spec.config
    ctx = rlax_model.PackedContext(
        segment=row["segment"][None], parent=row["parent"][None], positions=row["positions"][None]
    )
    remat_mode = None if (cfg.remat == "none" or not remat) else cfg.remat
    hidden, _ = rlax_model.hidden_states(
        params, row["tokens"][None], row["positions"][None], config=spec.model, attention=_attention(spec),
        attention_context=ctx, remat=remat_mode,
    )  # fmt: skip
    return hidden[0]


@_invariant_rows
def _packed_outputs(
    spec: _Spec,
    params: Any,
    row: dict[str, jax.Array],
    source: jax.Array,
    targets: jax.Array,
    scored: jax.Array,
    *,
    remat: bool = True,
):
    """The policy's outputs for the rollouts of one packed row, in the padded row layout.

    row: one packed row; source [b, T-1]: where each rollout's predicting hidden state sits
    in it; targets [b, T-1]: the next tokens; scored [b, T-1] bool: the positions wanted
    (this row's rollouts' loss mask). -> logprobs, entropy [b, T-1] f32 (0 off `scored`),
    values [b, T-1] f32 or None, and the gathered hidden states [b, T-1, H]."""
    cfg, mc = spec.config, spec.model
    policy = jax.tree.map(lambda x: x.astype(_dtype(cfg)), params["policy"])
    hidden = _packed_hidden(spec, policy, row, remat=remat)[source]  # [b, T-1, H]
    w = rlax_model.lm_head_weight(policy, mc).astype(hidden.dtype)
    lp, ent = head_logprobs(
        hidden, targets, w, temperature=cfg.temperature, chunk_size=_chunk_size(spec, targets), scored=scored
    )
    if "value" not in params:
        return lp, ent, None, hidden
    return lp, ent, hidden.astype(jnp.float32) @ params["value"]["w"] + params["value"]["b"], hidden


def _packed_loss(spec: _Spec, params: Any, row: dict[str, jax.Array], j: jax.Array, mb, scale: float):
    """The objective of the rollouts packed in row j of minibatch `mb` (its padded-layout
    arrays and `pk_seq_row`/`pk_source`): the other rollouts are masked out, so the sum over
    the rows used is the minibatch's objective (every built-in loss adds up over rollouts)."""
    here = (mb["pk_seq_row"] == j)[:, None]
    mask = mb["mask"] * here
    lp, ent, values, _ = _packed_outputs(spec, params, row, mb["pk_source"], mb["tokens"][:, 1:], mask > 0)
    return _objective(spec, mb, mask, mb["weights"] * here, lp, ent, values, scale)


def _merge_metrics(
    cfg: LearnerConfig, metrics: dict[str, jax.Array], tokens: jax.Array, ran: jax.Array | None
):
    """Per-pass metrics [passes] -> one value each; `ran` [passes] bool marks passes that ran
    (None: all); `tokens` [passes]: response tokens per pass (the weights of token means)."""
    merged = {}
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


def _packed_minibatch_step(spec: _Spec, carry, mb: dict[str, jax.Array]):
    """`_minibatch_step` over packed rows: one forward/backward pass per row used."""
    params, opt_state = carry
    cfg = spec.config
    b = mb["tokens"].shape[0]
    grad_fn = jax.grad(functools.partial(_packed_loss, spec, scale=float(cfg.minibatches)), has_aux=True)

    def row(j):
        return {k: mb[f"pk_{k}"][j] for k in _ROW_FIELDS}

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

    def body(state):
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


def _apply_gradients(cfg: LearnerConfig, params, opt_state, grads, merged, logprobs):
    """One optax step; -> ((params, opt_state), metrics with `grad_norm` and the pass's `logprobs`)."""
    merged["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = make_optimizer(cfg.optimizer).update(grads, opt_state, params)
    merged["logprobs"] = logprobs
    return (optax.apply_updates(params, updates), opt_state), merged


def _packed_old_outputs(spec: _Spec, params: Any, ref: Any, mb: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """pi_old (and values, reference and sampler-support log-probs) of one packed minibatch,
    without gradient: the same passes as the update's, so on-policy ratios are exactly 1."""
    cfg = spec.config
    targets, scored = mb["tokens"][:, 1:], mb["mask"] > 0

    def outputs(j):
        row = {k: mb[f"pk_{k}"][j] for k in _ROW_FIELDS}
        here = scored & (mb["pk_seq_row"] == j)[:, None]
        lp, ent, values, hidden = _packed_outputs(
            spec, sg(params), row, mb["pk_source"], targets, here, remat=False
        )
        out = {"old_logprobs": lp, "old_entropy": ent}
        if values is not None:
            out["old_values"] = values
        if cfg.mode == "rl" and cfg.truncated_sampling:  # the same hidden states, another support
            policy = jax.tree.map(lambda x: x.astype(_dtype(cfg)), sg(params)["policy"])
            out["sampler_old_logprobs"] = _sampler_logprobs_of_hidden(spec, policy, hidden, targets)
        if ref is not None:
            ref_hidden = _packed_hidden(spec, ref, row, remat=False)[mb["pk_source"]]
            w = rlax_model.lm_head_weight(ref, spec.model).astype(ref_hidden.dtype)
            out["ref_logprobs"] = head_logprobs(
                ref_hidden, targets, w, temperature=cfg.temperature, chunk_size=_chunk_size(spec, targets),
                scored=here,
            )[0]  # fmt: skip
        return out

    shapes = jax.eval_shape(lambda: outputs(jnp.int32(0)))
    init = (jnp.int32(0), {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()})

    def body(state):
        j, acc = state
        here = (mb["pk_seq_row"] == j)[:, None]
        return j + 1, {k: jnp.where(here, v, acc[k]) for k, v in outputs(j).items()}

    return jax.lax.while_loop(lambda s: s[0] < mb["pk_rows_used"], body, init)[1]


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


def _reuses_policy_pass(spec: _Spec, has_values: bool, has_ref: bool) -> bool:
    """True when pi_old equals the policy of the (only) optimizer step: one minibatch, so the
    gradient pass's own log-probs (without gradient) are pi_old's, and the separate forward
    pass over the batch can be skipped (it costs a fifth of the update with remat). A value
    head (its old values shape the advantages) or a reference model keep the pass."""
    cfg = spec.config
    return cfg.mode == "rl" and cfg.minibatches == 1 and not has_values and not has_ref


def _minibatch_step(spec: _Spec, carry, mb: dict[str, jax.Array]):
    params, opt_state = carry
    cfg = spec.config
    n_micro = mb["tokens"].shape[0] // cfg.micro
    micro = jax.tree.map(lambda x: _micro_view(x, n_micro), mb)
    grad_fn = jax.grad(functools.partial(_loss, spec, scale=float(cfg.minibatches)), has_aux=True)

    def body(acc, xs):
        grads, (metrics, lp) = grad_fn(params, xs)
        tokens = xs["mask"].sum()
        return jax.tree.map(jnp.add, acc, grads), (metrics, tokens, lp)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (metrics, tokens, lp) = jax.lax.scan(body, zeros, micro)
    merged = _merge_metrics(cfg, metrics, tokens, None)
    rows = mb["tokens"].shape[0]
    logprobs = lp.swapaxes(0, 1).reshape(rows, *lp.shape[2:])  # back from the micro view
    return _apply_gradients(cfg, params, opt_state, grads, merged, logprobs)


@_invariant_rows
def _update(spec: _Spec, state: TrainState, ref: Any, batch: dict[str, jax.Array]):
    cfg = spec.config
    b = batch["tokens"].shape[0]
    mask = batch["mask"]
    n_micro_all = b // cfg.micro

    # (1) pi_old (and values, reference) by the trainer's own forward pass, no gradient.
    def old_body(_, xs):
        scored = xs["mask"] > 0
        lp, ent, values = _policy_outputs(
            spec, sg(state.params), xs["tokens"], xs["valid"], scored, remat=False
        )
        out = {"old_logprobs": lp, "old_entropy": ent}
        if values is not None:
            out["old_values"] = values
        if ref is not None:
            out["ref_logprobs"] = _reference_logprobs(spec, ref, xs["tokens"], xs["valid"], scored)
        if cfg.mode == "rl" and cfg.truncated_sampling:
            out["sampler_old_logprobs"] = _sampler_old_logprobs(
                spec, sg(state.params), xs["tokens"], xs["valid"]
            )
        return None, out

    reuse = _reuses_policy_pass(spec, has_values="value" in state.params, has_ref=ref is not None)
    # Packed (`rlax_trainer.packing`): the host dealt the rows into minibatches (`order`,
    # from the same key as below) and packed each; the `pk_` arrays are [minibatches, ...].
    packed = "pk_rows_used" in batch
    rng, sub = jax.random.split(jax.random.wrap_key_data(state.rng))
    row_order = batch["order"] if packed else minibatch_order(sub, b, cfg)

    def deal(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Batch-order rows -> [minibatches, rows, ...] in `row_order`, with the packing."""
        out = jax.tree.map(
            lambda x: x[row_order].reshape(cfg.minibatches, b // cfg.minibatches, *x.shape[1:]), arrays
        )
        if packed:
            out.update({k: v for k, v in batch.items() if k.startswith("pk_")})
        return out

    old: dict[str, jax.Array] = {}
    if not reuse and packed:
        dealt = deal({k: batch[k] for k in ("tokens", "mask")})
        old = jax.lax.map(lambda mb: _packed_old_outputs(spec, state.params, ref, mb), dealt)
        back = jnp.argsort(row_order)  # minibatch order -> batch order
        old = jax.tree.map(lambda x: x.reshape(b, *x.shape[2:])[back], old)
    elif not reuse:
        view = {k: _micro_view(batch[k], n_micro_all) for k in ("tokens", "valid", "mask")}
        _, old = jax.lax.scan(old_body, None, view)
        old = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(b, *x.shape[2:]), old)

    rows = {k: batch[k] for k in ("tokens", "valid", "mask", "worker_logprobs")}
    rows.update({k: v for k, v in old.items() if k != "old_entropy"})
    metrics: dict[str, jax.Array] = {}
    if cfg.mode == "rl":
        prep = prepare_batch(cfg.objective, batch["rewards"], mask, cfg.group_size, old.get("old_values"))
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
    step_fn = _packed_minibatch_step if packed else _minibatch_step
    (params, opt_state), mb_metrics = jax.lax.scan(
        functools.partial(step_fn, spec), (state.params, state.opt_state), deal(rows)
    )
    pass_logprobs = mb_metrics.pop("logprobs")  # [minibatches, rows, T-1]
    if reuse:  # one minibatch in batch order: the gradient pass's log-probs are pi_old's
        logprob_metrics(pass_logprobs[0])
    for k, v in mb_metrics.items():
        metrics[k] = v.max() if k.endswith("_max") else v.min() if k.endswith("_min") else v.mean()
    metrics["learning_rate"] = jnp.asarray(
        _lr_schedule(cfg.optimizer)(state.step * cfg.minibatches), jnp.float32
    )
    new_state = TrainState(params, opt_state, state.step + 1, jax.random.key_data(rng))
    return new_state, metrics


_update_jit = jax.jit(_update, static_argnums=(0,), donate_argnums=(1,))
# `batch_invariant`'s update: the compiler options of the engine's aligned mode, so that the
# trainer's log-probs are bitwise those of `rlax_inference.EngineConfig(aligned=True)`.
_update_jit_aligned = jax.jit(
    _update,
    static_argnums=(0,),
    donate_argnums=(1,),
    compiler_options=rlax_model.layers.ALIGNED_COMPILER_OPTIONS,
)


class Learner:
    """Holds the train state and the compiled update for one model and one LearnerConfig.

    model_config: `rlax_model.ModelConfig`; params: its parameter tree (any float dtype:
    copied to float32 masters). `reference_params` (frozen, for the KL term) defaults to
    a copy of `params` when the objective has a KL coefficient. `mesh`: shard params,
    optimizer state and batches over it (None: one device).
    """

    def __init__(
        self,
        model_config: rlax_model.ModelConfig,
        config: LearnerConfig,
        params: Any,
        *,
        reference_params: Any | None = None,
        mesh: Mesh | None = None,
        seed: int = 0,
    ) -> None:
        # The same dtype policy as the inference engine's (a float32 copy for bfloat16 on a CPU).
        self.model_config = rlax_model.dtype_policy(model_config)
        self.config = config
        self.mesh = mesh
        self.optimizer = make_optimizer(config.optimizer)
        self.lr_schedule = _lr_schedule(config.optimizer)
        obj = config.objective if config.mode == "rl" else None
        self.uses_value = obj is not None and obj.value is not None
        self.uses_reference = obj is not None and obj.kl.coef > 0
        # Copies: the update donates its state, which must never alias the caller's arrays.
        master = {"policy": jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)}
        if self.uses_value:
            master["value"] = {
                "w": jnp.zeros((model_config.hidden_size,), jnp.float32),
                "b": jnp.zeros((), jnp.float32),
            }
        ref = None
        if self.uses_reference:
            src = params if reference_params is None else reference_params
            ref = jax.tree.map(lambda x: jnp.array(x, _dtype(config), copy=True), src)
        rng = jax.random.key_data(jax.random.key(seed))
        if mesh is None:
            self._param_sh = self._ref_sh = self._opt_sh = self._state_sh = None
            opt_state = jax.jit(self.optimizer.init)(master)
            self.state = TrainState(master, opt_state, jnp.zeros((), jnp.int32), rng)
            self.reference_params = ref
        else:
            rep = replicated(mesh)
            self._param_sh = param_sharding(master, mesh)
            abstract_opt = jax.eval_shape(self.optimizer.init, master)
            self._opt_sh = optax.tree_map_params(
                self.optimizer,
                lambda _, s: s,
                abstract_opt,
                self._param_sh,
                transform_non_params=lambda _: rep,
            )
            master = put_global(master, self._param_sh)
            opt_state = jax.jit(self.optimizer.init, out_shardings=self._opt_sh)(master)
            self._state_sh = TrainState(self._param_sh, self._opt_sh, rep, rep)
            self.state = TrainState(
                master, opt_state, put_global(np.zeros((), np.int32), rep), put_global(np.asarray(rng), rep)
            )
            self._ref_sh = None if ref is None else param_sharding(ref, mesh)
            self.reference_params = None if ref is None else put_global(ref, self._ref_sh)
        self._update_fn = self._compile_update()
        # One XLA executable per batch signature (the padded length varies by bucket),
        # compiled ahead of the call so that compile time is measured apart from the step.
        self._executables: dict[tuple[Any, ...], Any] = {}
        self._pending: dict[tuple[Any, ...], concurrent.futures.Future[Any]] = {}
        self._compile_lock = threading.Lock()
        # Held by an update (or a caller's whole step, `busy()`) while it runs and by a
        # background compilation while it compiles: never both at once, so their memory does
        # not pile up (SmolLM2 on a CPU: +0.5 GB of peak RSS per overlapped trainer step).
        self._heavy = threading.RLock()
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self.last_seq_len: int | None = None  # padded length the last update ran at
        self.last_compile_seconds = 0.0  # what the last update spent compiling (0: reused)

    def _compile_update(self):
        spec = _Spec(self.model_config, self.config)
        aligned = self.config.batch_invariant
        if self.mesh is None:
            return functools.partial(_update_jit_aligned if aligned else _update_jit, spec)
        rep = replicated(self.mesh)
        return jax.jit(
            functools.partial(_update, spec),
            in_shardings=(self._state_sh, self._ref_sh, batch_sharding(self.mesh)),
            out_shardings=(self._state_sh, rep),
            donate_argnums=(0,),
            compiler_options=rlax_model.layers.ALIGNED_COMPILER_OPTIONS if aligned else None,
        )

    # ------------------------------------------------------------------ public
    def update(self, batch: RolloutBatch | dict[str, np.ndarray]) -> dict[str, float]:
        """One update from a batch of exactly `global_batch` rollouts; returns host metrics."""
        arrays = batch_arrays(batch) if isinstance(batch, RolloutBatch) else dict(batch)
        b = arrays["tokens"].shape[0]
        arrays.setdefault("versions", np.full((b,), -1, np.int32))  # unknown: counts as stale
        if b != self.config.global_batch:
            raise ValueError(f"batch has {b} rollouts, expected global_batch={self.config.global_batch}")
        s = arrays["tokens"].shape[1]
        for name, want in (
            ("valid", (b, s)),
            ("mask", (b, s - 1)),
            ("worker_logprobs", (b, s - 1)),
            ("rewards", (b,)),
            ("versions", (b,)),
        ):
            if arrays[name].shape != want:
                raise ValueError(f"batch field {name} has shape {arrays[name].shape}, expected {want}")
        arrays, work = self._lay_out(arrays)
        self.last_seq_len = int(arrays["tokens"].shape[1])
        if self.mesh is not None:
            arrays = put_global(arrays, self._input_shardings(arrays))
        executable = self._executable(arrays)
        if self.last_compile_seconds:
            # The compiler's freed memory, before the update maps its temporaries: on top of
            # ~220 MiB of it the first update of SmolLM2 (64 new tokens) set the trainer's
            # peak (3,689 MiB; 3,503 with this trim; later updates 3.15 GB).
            release_free_memory()
        with self.busy() as waited:
            self.last_compile_seconds += waited
            before = jax.tree.leaves(self.state.params)
            self.state, metrics = executable(self.state, self.reference_params, arrays)
            out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # The update donates the state: a master buffer something else still referenced (a
        # zero-copy host view, e.g. of a push in flight) cannot be donated, and XLA allocates
        # a copy of it instead: that much more memory for the step.
        out["trainer_undonated_mb"] = sum(x.nbytes for x in before if not x.is_deleted()) / 2**20
        out["trainer_seq_len"] = float(self.last_seq_len)  # padded length it ran at
        out.update(work)
        out["trainer_compile_seconds"] = self.last_compile_seconds
        out.update(peak_memory_metrics())
        return out

    def _lay_out(
        self, arrays: dict[str, np.ndarray], pack_lengths: list[int] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The update's input arrays for a batch (packed, or trimmed to its length bucket) and
        what its passes compute: `train_token_efficiency` (real tokens / positions computed)
        and `train_compute_ratio` (positions computed / the rollouts' tokens: below 1 when
        shared prefixes are computed once)."""
        cfg = self.config
        rollout_tokens = int(np.asarray(arrays["valid"]).sum())
        if self._packs():
            tokens = np.asarray(arrays["tokens"])
            b, s = tokens.shape
            order = self._row_order(b)
            lengths = pack_lengths or self.pack_lengths(s)
            align = rlax_model.attention.KEY_BLOCK if cfg.batch_invariant else 1
            layout = best_layout(
                tokens, np.asarray(arrays["valid"]), order, cfg.minibatches, cfg.group_size, lengths, align
            )
            arrays = {**arrays, **layout.arrays(), "order": order.astype(np.int32)}
            computed, real = layout.computed_tokens, int((layout.segment > 0).sum())
        else:
            if cfg.trim_padding:
                arrays = trim_to_bucket(arrays)
            computed, real = int(np.prod(arrays["tokens"].shape)), rollout_tokens
        work = {
            "train_token_efficiency": real / max(computed, 1),
            "train_compute_ratio": computed / max(rollout_tokens, 1),
            "train_computed_tokens": float(computed),
        }
        return arrays, work

    def pack_lengths(self, seq_len: int) -> list[int]:
        """The packed row lengths batches padded to `seq_len` may run at (one program each)."""
        return [self.config.pack_length] if self.config.pack_length else candidate_lengths(seq_len)

    def _packs(self) -> bool:
        """Whether updates run packed: `packing` on one device (a mesh runs rows padded)."""
        return self.config.packing and self.mesh is None

    def _row_order(self, rows: int) -> np.ndarray:
        """The row order the update deals minibatches in (`minibatch_order` with the key the
        jitted update splits off the state's), computed here so that the host can pack."""
        key = jax.random.wrap_key_data(jnp.asarray(np.asarray(jax.device_get(self.state.rng))))
        return np.asarray(minibatch_order(jax.random.split(key)[1], rows, self.config))

    def _input_shardings(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Per-row arrays sharded over the batch axis; the packing's arrays replicated."""
        assert self.mesh is not None
        rep = replicated(self.mesh)
        return {k: rep if k.startswith("pk_") or k == "order" else batch_sharding(self.mesh) for k in arrays}

    def _lower(self, arrays: dict[str, Any], state: Any = None, reference: Any = None) -> Any:
        state = self.state if state is None else state
        reference = self.reference_params if reference is None else reference
        fn = self._update_fn
        if isinstance(fn, functools.partial) and fn.func in (_update_jit, _update_jit_aligned):
            return fn.func.lower(fn.args[0], state, reference, arrays)
        return fn.lower(state, reference, arrays)

    @staticmethod
    def _signature(arrays: dict[str, Any]) -> tuple[Any, ...]:
        return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(arrays.items()))

    def _executable(self, arrays: dict[str, Any]) -> Any:
        """The compiled update for these arrays' shapes and dtypes (compiled once, timed into
        `last_compile_seconds`; JAX's persistent cache, when configured, serves it too)."""
        key = self._signature(arrays)
        self.last_compile_seconds = 0.0
        with self._compile_lock:
            executable, pending = self._executables.get(key), self._pending.get(key)
        if executable is not None:
            return executable
        if pending is not None and pending.done():
            executable = pending.result()  # compiled ahead, while nothing waited for it
        else:
            # Not compiled yet: compile here. Waiting for the background thread could deadlock
            # (it compiles only while no step holds `busy()`); a job not started is dropped,
            # one started finds this program in the table and stops.
            if pending is not None:
                pending.cancel()
            started = time.perf_counter()
            executable = self._lower(arrays).compile()
            self.last_compile_seconds = time.perf_counter() - started
        with self._compile_lock:
            self._executables[key] = executable
            self._pending.pop(key, None)
        return executable

    def precompile(self, seq_lens: list[int]) -> list[concurrent.futures.Future[Any]]:
        """Compile the update for batches padded to each of `seq_lens` in a background
        thread (one program at a time, never while an update or a `busy()` step runs), so
        that the steps that first meet those lengths do not compile; a step that meets a
        length not compiled yet compiles it itself. Call it while the trainer would
        otherwise wait (before the first batch). Returns the compilations it started."""

        def abstract(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None))

        b = self.config.global_batch
        state = jax.tree.map(abstract, self.state)  # the live state is donated by each update
        reference = jax.tree.map(abstract, self.reference_params)
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="precompile")
        started = []
        # Packed batches keep the length they were padded to (the longest) and run at one of
        # a few row lengths; padded ones at their length bucket.
        s_max = max(seq_lens)
        shapes = [(s_max, [n], r) for n in self.pack_lengths(s_max) for r in (1, 2)] if self._packs() else []
        shapes = shapes or [(s, None, 0) for s in sorted(set(seq_lens))]
        for s, pack_length, packed_rows in shapes:
            # The arrays `batch_arrays` makes of a batch padded to s (their dtypes from it),
            # laid out as the update will (packed into one row or several, or at full length).
            rows, cols = np.zeros((b, s)), np.zeros((b, s - 1))
            # Rollouts of 2 tokens sharing 1 pack into one row; full-row ones into several.
            real = 2 if packed_rows == 1 else min(s, pack_length[0] if pack_length else s)
            valid = np.repeat(np.arange(s)[None, :] < real, b, 0)
            padded = RolloutBatch(rows, valid, cols, cols, np.zeros(b), np.zeros(b))
            laid_out, _ = self._lay_out(batch_arrays(padded), pack_length)
            shardings = None if self.mesh is None else self._input_shardings(laid_out)
            arrays = {
                k: abstract(v, None if shardings is None else shardings[k]) for k, v in laid_out.items()
            }
            key = self._signature(arrays)
            with self._compile_lock:
                if key in self._executables or key in self._pending:
                    continue
                self._pending[key] = self._compiler.submit(self._compile_apart, arrays, state, reference)
                started.append(self._pending[key])
        return started

    @contextlib.contextmanager
    def busy(self) -> Iterator[float]:
        """`with learner.busy() as waited:` around work that allocates a lot (an update; a
        trainer's whole step with its checkpoint and push): `precompile`'s thread does not
        compile meanwhile. `waited`: seconds spent waiting for a compilation in progress to
        finish (0.0 when none was), which callers count as compile time. Reentrant."""
        waited = 0.0
        if not self._heavy.acquire(blocking=False):
            started = time.perf_counter()
            self._heavy.acquire()
            waited = time.perf_counter() - started
        try:
            yield waited
        finally:
            self._heavy.release()

    def _compile_apart(self, arrays: dict[str, Any], state: Any, reference: Any) -> Any:
        lowered = self._lower(arrays, state, reference)
        with self._heavy:
            with self._compile_lock:
                done = self._executables.get(self._signature(arrays))
            return done if done is not None else lowered.compile()

    def stop_precompile(self) -> None:
        """Drop the lengths `precompile` has not started (the one compiling finishes)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None
            with self._compile_lock:
                self._pending = {k: f for k, f in self._pending.items() if not f.cancelled()}

    def compiled_memory(self, batch: RolloutBatch | dict[str, np.ndarray]) -> dict[str, int]:
        """XLA's memory analysis of the update compiled for this batch's shapes (nothing runs).

        Returns {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes"}: temp is
        the scratch the program needs beyond its inputs and outputs (activations, logits).
        """
        arrays = batch_arrays(batch) if isinstance(batch, RolloutBatch) else dict(batch)
        arrays.setdefault("versions", np.full((arrays["tokens"].shape[0],), -1, np.int32))
        m = self._lower(self._lay_out(arrays)[0]).compile().memory_analysis()
        return {
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes),
        }

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    def policy_params(self) -> Any:
        """The float32 master weights of the policy (global arrays)."""
        return self.state.params["policy"]

    def host_params(self) -> Any:
        """All trainable params as numpy on this process (gathered across processes)."""
        return to_host(self.state.params)

    def load_state(self, state: TrainState) -> None:
        """Replace the train state (e.g. restored from a checkpoint); re-shards it onto the mesh."""
        if self.mesh is not None:
            state = put_global(state, self._state_sh)
        self.state = state
