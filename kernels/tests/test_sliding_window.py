"""Sliding-window decode attention (``ModelConfig.sliding_window``, Mistral-style) on the
reference and the CPU decode paths, against a float64 numpy formula.

Tokens before the window are poisoned with NaN in the cache: a path that reads or weights
one of them produces NaN instead of a plausible number.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_kernels import paged_attention, paged_attention_cpu, paged_attention_reference, paged_attention_xla
from rlax_kernels.paged_attention.testing import make_paged_case

LENGTHS = [1, 16, 33, 64, 5]  # cached tokens: one, a full page, ragged, four pages, short
PAGE, HEADS, KV_HEADS, DIM = 16, 4, 2, 32


def windowed_attention_float64(q, keys, values, window):
    """One query over a sequence's keys/values [tokens, kv_heads, dim] (query last), seeing the last `window`."""
    keys, values = keys[-window:], values[-window:]
    group = HEADS // KV_HEADS
    out = np.zeros((HEADS, DIM))
    for head in range(HEADS):
        kv = head // group
        scores = keys[:, kv] @ q[head].astype(np.float64) / np.sqrt(DIM)
        weights = np.exp(scores - scores.max())
        out[head] = weights @ values[:, kv] / weights.sum()
    return out


def sequences(case, lengths):
    """Each sequence's cached K and V, [tokens, kv_heads, dim] float64, read through its block table."""
    k, v, tables = (np.asarray(a, np.float64) for a in (case.k_pages, case.v_pages, case.block_tables))
    out = []
    for b, n in enumerate(lengths):
        pages = tables[b, : -(-n // PAGE)].astype(int)
        ks = k[:, pages].reshape(KV_HEADS, -1, DIM)[:, :n].transpose(1, 0, 2)
        vs = v[:, pages].reshape(KV_HEADS, -1, DIM)[:, :n].transpose(1, 0, 2)
        out.append((ks, vs))
    return out


def poison_before_window(case, lengths, window, seen):
    """Copies of the pages with every cached token before each query's window set to NaN."""
    k, v = np.array(case.k_pages), np.array(case.v_pages)
    tables = np.asarray(case.block_tables)
    for b, (n, total) in enumerate(zip(lengths, seen, strict=True)):
        for t in range(max(min(total - window, n), 0)):
            page, slot = tables[b, t // PAGE], t % PAGE
            k[:, page, slot] = v[:, page, slot] = np.nan
    return jnp.asarray(k), jnp.asarray(v)


# The reference and the Pallas kernels take no new token (the query's K/V is in the cache);
# the engine's CPU/XLA paths run with one (and without, as a kernel). The TPU kernel's
# interpret mode emulates its DMAs step by step: slow on CPU.
PATHS = [
    ("reference", False), ("xla", False), ("xla", True), ("cpu", False), ("cpu", True), ("pallas_gpu", False), ("pallas_gpu", True),
    pytest.param("pallas_tpu", False, marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.parametrize("window", [1, 3, 17, 1000])
@pytest.mark.parametrize("path,with_new", PATHS)
def test_decode_sees_only_the_window(window, path, with_new):
    case = make_paged_case(
        11, seq_lens=LENGTHS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, page_size=PAGE
    )
    rng = np.random.default_rng(window)
    new_k = rng.normal(size=(len(LENGTHS), KV_HEADS, DIM)).astype(np.float32)
    new_v = rng.normal(size=new_k.shape).astype(np.float32)
    seen = [n + 1 if with_new else n for n in LENGTHS]
    expected = []
    for b, (ks, vs) in enumerate(sequences(case, LENGTHS)):
        if with_new:
            ks, vs = np.concatenate([ks, new_k[b][None]]), np.concatenate([vs, new_v[b][None]])
        expected.append(windowed_attention_float64(np.asarray(case.q[b]), ks, vs, window))
    k, v = poison_before_window(case, LENGTHS, window, seen)
    extras = {"new_k": jnp.asarray(new_k), "new_v": jnp.asarray(new_v)} if with_new else {}
    if path == "reference":
        out = paged_attention_reference(case.q, k, v, case.seq_lens, case.block_tables, sliding_window=window)
    elif path.startswith("pallas"):
        if with_new:  # through a layer axis too, as the engine reads it
            k, v = jnp.stack([jnp.full_like(k, jnp.nan), k]), jnp.stack([jnp.full_like(v, jnp.nan), v])
            extras["layer"] = 1
        out = paged_attention(
            case.q,
            k,
            v,
            case.seq_lens,
            case.block_tables,
            backend=path,
            interpret=True,
            sliding_window=window,
            **extras,
        )
    else:
        attend = {"xla": paged_attention_xla, "cpu": paged_attention_cpu}[path]
        # Read through a layer axis, as the engine does (layer 1 of 2; layer 0 is all NaN).
        k, v = jnp.stack([jnp.full_like(k, jnp.nan), k]), jnp.stack([jnp.full_like(v, jnp.nan), v])
        out = attend(case.q, k, v, case.seq_lens, case.block_tables, layer=1, sliding_window=window, **extras)
    np.testing.assert_allclose(np.asarray(out), np.stack(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "attend", [paged_attention_reference, paged_attention_xla, paged_attention_cpu, paged_attention]
)
@pytest.mark.parametrize("window", [0, -2, 2.5, True])
def test_bad_windows_are_refused(attend, window):
    case = make_paged_case(
        1, seq_lens=[3], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, page_size=PAGE
    )
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        attend(case.q, case.k_pages, case.v_pages, case.seq_lens, case.block_tables, sliding_window=window)
