"""The online-softmax update that the Pallas GPU and TPU kernels share.

Attention over keys that arrive a block at a time keeps three running values per query
row (the flash-attention recurrence):

- ``m``: the largest score seen so far;
- ``l``: the sum of ``exp(score - m)`` over the keys seen so far;
- ``acc``: the sum of ``exp(score - m) * value`` over the same keys.

Each block raises ``m`` to the block's maximum, rescales ``l`` and ``acc`` by
``exp(m_old - m_new)`` and adds the block's own terms; after the last block
``acc / l`` is ``softmax(scores) @ values`` over all keys, as if taken in one pass.

The functions are plain ``jnp`` on arrays, so they run inside a Pallas kernel body (Triton
or Mosaic) as well as outside one. The running max and sum have shape ``[rows]`` or
``[rows, 1]``: the GPU kernel carries vectors through its loop, the TPU kernel keeps
``[rows, 1]`` tiles in VMEM scratch (Mosaic wants 2-D values); the shape of ``m`` chooses.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

OnlineSoftmax = tuple[jax.Array, jax.Array, jax.Array]
"""``(m, l, acc)``: running max ``[rows]`` or ``[rows, 1]`` float32, running sum (shape of
``m``) float32, and accumulator ``[rows, head_dim]`` float32."""


def online_softmax_init(rows: int, head_dim: int, *, keepdims: bool = False) -> OnlineSoftmax:
    """The state before any key: ``m = -inf``, ``l = 0``, ``acc = 0``.

    Returns:
      ``(m, l, acc)`` with ``m``, ``l``: ``[rows]`` float32 (``[rows, 1]`` with ``keepdims``)
      and ``acc``: ``[rows, head_dim]`` float32.
    """
    stat_shape = (rows, 1) if keepdims else (rows,)
    return (
        jnp.full(stat_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stat_shape, jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def _fold(
    state: OnlineSoftmax, scores: jax.Array, weighted_sum: Callable[[jax.Array], jax.Array]
) -> OnlineSoftmax:
    """The update itself; `weighted_sum` maps ``probs: [rows, keys]`` float32 to ``probs @ values``."""
    m_prev, l_prev, acc_prev = state
    keepdims = m_prev.ndim == 2
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=keepdims))
    # A row that has seen no allowed key yet keeps m = -inf; keep its update finite.
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)
    m_col, alpha_col = (m_safe, alpha) if keepdims else (m_safe[:, None], alpha[:, None])
    probs = jnp.exp(scores - m_col)  # [rows, keys]
    l_next = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=keepdims)
    return m_next, l_next, alpha_col * acc_prev + weighted_sum(probs)


def online_softmax_update(
    state: OnlineSoftmax,
    scores: jax.Array,
    values: jax.Array,
    *,
    precision: lax.PrecisionLike = None,
) -> OnlineSoftmax:
    """Fold one block of keys into the running softmax state.

    Args:
      state: ``(m, l, acc)`` as returned by `online_softmax_init` or an earlier update.
      scores: ``[rows, keys]`` float32, already scaled; ``-inf`` where a key is masked. A
        row may be all ``-inf`` (it stays at ``m = -inf``, ``l = 0``, ``acc = 0``).
      values: ``[keys, head_dim]`` in the cache dtype. Rows of masked keys must already be
        zero: their probability is 0, but ``0 * NaN`` (garbage in an unused slot) is NaN.
      precision: of the ``P @ V`` product (``lax.Precision.HIGHEST`` for exact float32).

    Returns:
      The new ``(m, l, acc)``, shapes and dtypes as ``state``.

    ``P @ V`` takes the probabilities in ``values``' dtype (the tensor-core / MXU operand
    type) and accumulates in float32.
    """

    def weighted_sum(probs: jax.Array) -> jax.Array:
        return lax.dot_general(
            probs.astype(values.dtype),
            values,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    return _fold(state, scores, weighted_sum)


def online_softmax_add_key(state: OnlineSoftmax, score: jax.Array, value: jax.Array) -> OnlineSoftmax:
    """Fold a single key (the newest token, not in the cache) into the running state.

    Args:
      state: ``(m, l, acc)``.
      score: ``[rows, 1]`` float32, already scaled.
      value: ``[1, head_dim]``, any float dtype.

    Returns:
      The new ``(m, l, acc)``. The same update as `online_softmax_update`, but the product
      is a float32 broadcast multiply: a dot with one contraction step is too small for
      Triton's tensor-core dot, and the probability is not rounded to the cache dtype.
    """
    return _fold(state, score, lambda probs: probs * value.astype(jnp.float32))


def online_softmax_finish(state: OnlineSoftmax) -> jax.Array:
    """``acc / l``: the attention output ``[rows, head_dim]`` float32; rows that saw no key are 0."""
    _, l_sum, acc = state
    l_safe = jnp.where(l_sum == 0.0, 1.0, l_sum)
    return acc / (l_safe if l_sum.ndim == 2 else l_safe[:, None])
