"""The learner's forward passes: the policy's log-probs, entropies and values over a padded
batch or a packed row, pi_old on the sampler's top-p/top-k support, and the KL reference's
log-probs. Each is traced inside the jitted update (`rlax_trainer.learner_update`) for one
`UpdateSpec`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

import rlax_model
import rlax_model.lora
from rlax_model.logprobs import head_logprobs
from rlax_trainer.config import LearnerConfig

__all__ = [
    "DENSE_LOGITS_ELEMENTS",
    "PACKED_ROW_FIELDS",
    "UpdateSpec",
    "compute_dtype",
    "invariant_rows",
    "with_base",
    "logprob_chunk_size",
    "packed_hidden",
    "packed_outputs",
    "policy_outputs",
    "reference_logprobs",
    "sampler_logprobs",
    "sampler_logprobs_of_hidden",
    "sampler_old_logprobs",
]


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
    """Hashable static description of the update: equal specs share one compiled program."""

    model: rlax_model.ModelConfig
    config: LearnerConfig


def compute_dtype(cfg: LearnerConfig) -> jnp.dtype:
    """The forward pass's parameter dtype after `rlax_model.dtype_policy` (float32 for bfloat16 on a CPU)."""
    dtype: jnp.dtype = (
        jnp.bfloat16 if rlax_model.resolve_dtypes(cfg.param_dtype)[0] == "bfloat16" else jnp.float32
    )
    return dtype


# Below this many logits elements ([rows, S-1, V] of one micro-batch, 16 MB in float32) the
# vocabulary projection runs dense: chunking only saves memory, and on a small vocabulary
# its scan, gather and recomputation cost more than the projection (the demo's update took
# 0.19 s chunked, 0.11 s dense).
DENSE_LOGITS_ELEMENTS = 1 << 22


def invariant_rows(fn: Any) -> Any:
    """Trace `fn(spec, ...)` with matmuls in blocks of `ALIGNED_ROW_BLOCK` rows when the
    config asks for batch invariance (the spec is static: each setting compiles apart); the
    update then compiles with `ALIGNED_COMPILER_OPTIONS`. A row's bits then do not depend on
    how many rows share its matmul (`rlax_model.layers.ALIGNED_ROW_BLOCK` says why blocks)."""

    @functools.wraps(fn)
    def traced(spec: UpdateSpec, *args: Any, **kwargs: Any) -> Any:
        rows = rlax_model.layers.ALIGNED_ROW_BLOCK if spec.config.batch_invariant else 0
        with rlax_model.layers.matmul_row_blocks(rows):
            return fn(spec, *args, **kwargs)

    return traced


def with_base(spec: UpdateSpec, params: Any, base: Any) -> Any:
    """The update's trainable params as the passes take them: `params` itself, or under
    `lora` ({"lora": adapters, ...} trained, `base` frozen) the same with "policy" = the
    base with the adapters attached unmerged (`rlax_model.lora.with_adapters`). `base` is
    a constant of the loss, so gradients reach only the adapters."""
    lora = spec.config.lora
    if lora is None:
        return params
    rest = {k: v for k, v in params.items() if k != "lora"}
    return {**rest, "policy": rlax_model.lora.with_adapters(base, params["lora"], lora.scale)}


def _attention(spec: UpdateSpec) -> Any:
    """The passes' attention function: blocked (batch-invariant) when the config asks for it,
    else None (the model's default)."""
    if not spec.config.batch_invariant:
        return None
    return functools.partial(
        rlax_model.dense_causal_attention,
        sliding_window=spec.model.sliding_window,
        key_block=rlax_model.attention.KEY_BLOCK,
    )


def logprob_chunk_size(spec: UpdateSpec, tokens: jax.Array) -> int | None:
    """`logprob_chunk_size`, or None (dense) when the micro-batch's full logits are small."""
    rows, seq = tokens.shape
    if rows * (seq - 1) * spec.model.vocab_size <= DENSE_LOGITS_ELEMENTS:
        return None
    return spec.config.logprob_chunk_size


@invariant_rows
def policy_outputs(
    spec: UpdateSpec,
    params: Any,
    tokens: jax.Array,
    valid: jax.Array,
    scored: jax.Array,
    *,
    remat: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """-> logprobs [b, S-1] f32, entropy [b, S-1] f32, values [b, S-1] f32 or None; the
    log-probs and entropies only where `scored` [b, S-1] (the loss mask), 0 elsewhere."""
    cfg, mc = spec.config, spec.model
    policy = jax.tree.map(lambda x: x.astype(compute_dtype(cfg)), params["policy"])
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
            chunk_size=logprob_chunk_size(spec, tokens),
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
        chunk_size=logprob_chunk_size(spec, tokens),
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


@invariant_rows
def sampler_old_logprobs(spec: UpdateSpec, params: Any, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """pi_old's log-probs [b, S-1] on the sampler's top-p/top-k support (see `sampler_logprobs`),
    over chunks of `logprob_chunk_size` tokens (a [chunk, V] sort each); no gradient."""
    cfg, mc = spec.config, spec.model
    policy = jax.tree.map(lambda x: x.astype(compute_dtype(cfg)), params["policy"])
    ctx = rlax_model.DenseContext(valid=valid)
    positions = rlax_model.positions_from_valid(valid)
    hidden, _ = rlax_model.hidden_states(
        policy, tokens, positions, config=mc, attention=_attention(spec), attention_context=ctx
    )
    return sampler_logprobs_of_hidden(spec, policy, hidden[:, :-1], tokens[:, 1:])


def sampler_logprobs_of_hidden(
    spec: UpdateSpec, policy: Any, hidden: jax.Array, targets: jax.Array
) -> jax.Array:
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

    def one(xs: tuple[jax.Array, jax.Array]) -> jax.Array:
        logits = jnp.einsum("nh,hv->nv", xs[0], w, preferred_element_type=jnp.float32)
        return sampler_logprobs(logits, xs[1], temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)

    out: jax.Array = jax.lax.map(one, (hid, tgt)).reshape(-1)[:total].reshape(lead)
    return out


@invariant_rows
def reference_logprobs(
    spec: UpdateSpec, ref: Any, tokens: jax.Array, valid: jax.Array, scored: jax.Array
) -> jax.Array:
    ctx = rlax_model.DenseContext(valid=valid)
    return rlax_model.logprobs(
        ref,
        tokens,
        config=spec.model,
        attention=_attention(spec),
        attention_context=ctx,
        temperature=spec.config.temperature,
        chunk_size=logprob_chunk_size(spec, tokens),
        scored=scored,
    )


# Packed passes (`rlax_trainer.packing`): several rollouts share one row.
PACKED_ROW_FIELDS = ("tokens", "segment", "parent", "positions")


def packed_hidden(spec: UpdateSpec, params: Any, row: dict[str, jax.Array], *, remat: bool) -> jax.Array:
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


@invariant_rows
def packed_outputs(
    spec: UpdateSpec,
    params: Any,
    row: dict[str, jax.Array],
    source: jax.Array,
    targets: jax.Array,
    scored: jax.Array,
    *,
    remat: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array]:
    """The policy's outputs for the rollouts of one packed row, in the padded row layout.

    row: one packed row; source [b, T-1]: where each rollout's predicting hidden state sits
    in it; targets [b, T-1]: the next tokens; scored [b, T-1] bool: the positions wanted
    (this row's rollouts' loss mask). -> logprobs, entropy [b, T-1] f32 (0 off `scored`),
    values [b, T-1] f32 or None, and the gathered hidden states [b, T-1, H]."""
    cfg, mc = spec.config, spec.model
    policy = jax.tree.map(lambda x: x.astype(compute_dtype(cfg)), params["policy"])
    hidden = packed_hidden(spec, policy, row, remat=remat)[source]  # [b, T-1, H]
    w = rlax_model.lm_head_weight(policy, mc).astype(hidden.dtype)
    lp, ent = head_logprobs(
        hidden,
        targets,
        w,
        temperature=cfg.temperature,
        chunk_size=logprob_chunk_size(spec, targets),
        scored=scored,
    )
    if "value" not in params:
        return lp, ent, None, hidden
    return lp, ent, hidden.astype(jnp.float32) @ params["value"]["w"] + params["value"]["b"], hidden
