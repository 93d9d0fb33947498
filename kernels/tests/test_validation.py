"""Bad shapes, dtypes, knobs and backends fail eagerly with messages that name them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_kernels import paged_attention, paged_prefill_attention, resolve_backend, write_kv


def _decode_args(batch=2, heads=4, kv_heads=2, head_dim=16, pages=6, page_size=8, max_pages=3):
    return dict(
        q=jnp.zeros((batch, heads, head_dim), jnp.float32),
        k_pages=jnp.zeros((kv_heads, pages, page_size, head_dim), jnp.float32),
        v_pages=jnp.zeros((kv_heads, pages, page_size, head_dim), jnp.float32),
        lengths=jnp.ones((batch,), jnp.int32),
        block_tables=jnp.zeros((batch, max_pages), jnp.int32),
    )


def _call(**overrides):
    args = _decode_args()
    kwargs = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return paged_attention(**args, **kwargs)


@pytest.mark.parametrize(
    "override,needle",
    [
        ({"q": jnp.zeros((2, 4), jnp.float32)}, "q must be [batch, num_heads, head_dim]"),
        ({"q": jnp.zeros((2, 3, 16), jnp.float32)}, "num_heads 3 is not a multiple of num_kv_heads 2"),
        ({"q": jnp.zeros((2, 4, 32), jnp.float32)}, "head_dim 32 differs"),
        ({"q": jnp.zeros((2, 4, 16), jnp.bfloat16)}, "share one dtype"),
        ({"k_pages": jnp.zeros((2, 6, 8), jnp.float32)}, "k_pages must be"),
        ({"v_pages": jnp.zeros((2, 5, 8, 16), jnp.float32)}, "v_pages must have the shape of k_pages"),
        ({"lengths": jnp.ones((3,), jnp.int32)}, "lengths must be an integer array of shape [batch=2]"),
        ({"lengths": jnp.ones((2,), jnp.float32)}, "lengths must be an integer array"),
        ({"block_tables": jnp.zeros((3, 3), jnp.int32)}, "block_tables must be [batch=2"),
        ({"block_tables": jnp.zeros((2, 3), jnp.float32)}, "block_tables must be an integer array"),
    ],
)
def test_bad_shapes_raise_and_print_them(override, needle) -> None:
    with pytest.raises(ValueError) as info:
        _call(**override)
    message = str(info.value)
    assert needle in message
    # The message prints every argument's shape.
    assert "q=(" in message and "k_pages=(" in message and "block_tables=(" in message


def test_concrete_lengths_out_of_range_raise() -> None:
    with pytest.raises(ValueError, match=r"\[1, max_pages_per_seq \* page_size = 24\], got \[0, 1\]"):
        _call(lengths=jnp.asarray([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="got \\[25, 1\\]"):
        _call(lengths=jnp.asarray([25, 1], jnp.int32))


def test_shape_checks_also_run_under_an_outer_jit() -> None:
    args = _decode_args()
    args["q"] = jnp.zeros((2, 3, 16), jnp.float32)
    with pytest.raises(ValueError, match="num_heads 3"):
        jax.jit(lambda a: paged_attention(**a))(args)
    # Traced lengths cannot be range-checked but must still work.
    good = _decode_args()
    out = jax.jit(lambda a: paged_attention(**a))(good)
    assert out.shape == (2, 4, 16)


def test_backend_choice_fails_loudly() -> None:
    assert resolve_backend("auto", False) == "cpu"  # the tests run with JAX_PLATFORMS=cpu
    with pytest.raises(ValueError, match="backend must be one of"):
        _call(backend="triton")
    with pytest.raises(ValueError, match="compiles only on tpu.*interpret=True"):
        _call(backend="pallas_tpu")
    with pytest.raises(ValueError, match="compiles only on gpu"):
        _call(backend="pallas_gpu")
    with pytest.raises(ValueError, match="needs a named kernel"):
        _call(interpret=True)
    with pytest.raises(ValueError, match="Pallas kernels only"):
        _call(backend="xla", interpret=True)
    with pytest.raises(ValueError, match="Pallas kernels only"):
        _call(backend="cpu", interpret=True)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"backend": "pallas_gpu", "pages_per_compute_block": 3}, "pages_per_compute_block a power of two"),
        ({"backend": "pallas_gpu", "block_rows": 24}, "block_rows a power of two >= 16"),
        ({"backend": "pallas_tpu", "pages_per_compute_block": 0}, "pages_per_compute_block must be >= 1"),
    ],
)
def test_bad_knobs_raise(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        _call(interpret=True, **kwargs)


def test_kernel_layout_limits_raise() -> None:
    args = _decode_args(page_size=12, head_dim=24)
    args["k_pages"] = args["v_pages"] = jnp.zeros((2, 6, 12, 24), jnp.float32)
    with pytest.raises(ValueError, match="head_dim a power of two"):
        paged_attention(**args, backend="pallas_gpu", interpret=True)
    with pytest.raises(ValueError, match="page_size a multiple of 8 for 4-byte data, got 12"):
        paged_attention(**args, backend="pallas_tpu", interpret=True)
    half = {
        k: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a
        for k, a in _decode_args(page_size=8).items()
    }
    with pytest.raises(ValueError, match="page_size a multiple of 16 for 2-byte data, got 8"):
        paged_attention(**half, backend="pallas_tpu", interpret=True)
    with pytest.raises(ValueError, match="block_rows a multiple of 16, got 8"):
        paged_attention(
            **_decode_args(page_size=16)
            | {
                k: a.astype(jnp.bfloat16)
                for k, a in _decode_args(page_size=16).items()
                if k in ("q", "k_pages", "v_pages")
            },
            backend="pallas_tpu",
            interpret=True,
            block_rows=8,
        )


def test_prefill_validation() -> None:
    k = jnp.zeros((1, 4, 8, 16), jnp.float32)
    q = jnp.zeros((2, 4, 2, 16), jnp.float32)
    tables = jnp.zeros((2, 4), jnp.int32)
    seq = jnp.asarray([4, 6], jnp.int32)
    with pytest.raises(ValueError, match="q must be \\[batch, chunk>=1"):
        paged_prefill_attention(q[:, 0], k, k, seq, seq, tables)
    with pytest.raises(ValueError, match="q_lens must not exceed seq_lens"):
        paged_prefill_attention(q, k, k, seq, jnp.asarray([4, 7], jnp.int32), tables)
    with pytest.raises(ValueError, match="q_lens must not exceed chunk=4"):
        paged_prefill_attention(
            q, k, k, jnp.asarray([5, 6], jnp.int32), jnp.asarray([5, 1], jnp.int32), tables
        )
    with pytest.raises(ValueError, match="q_lens must be >= 0"):
        paged_prefill_attention(q, k, k, seq, jnp.asarray([-1, 1], jnp.int32), tables)
    with pytest.raises(ValueError, match="q_lens must be an integer array of shape \\[batch=2\\]"):
        paged_prefill_attention(q, k, k, seq, jnp.asarray([1], jnp.int32), tables)


def test_write_kv_validation() -> None:
    k = jnp.zeros((2, 3, 4, 8), jnp.float32)
    new = jnp.zeros((5, 2, 8), jnp.float32)
    slots = jnp.arange(5, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"new_k and new_v must both be .*new_k=\(5, 1, 8\)"):
        write_kv(k, k, jnp.zeros((5, 1, 8)), jnp.zeros((5, 1, 8)), slots)
    with pytest.raises(ValueError, match=r"slot_mapping must be an integer \[num_tokens=5\]"):
        write_kv(k, k, new, new, slots[:4])
    with pytest.raises(ValueError, match="k_pages and v_pages must both be"):
        write_kv(k, k[:, :2], new, new, slots)
    with pytest.raises(ValueError, match="slot 12 is past the cache's 12 slots"):
        write_kv(k, k, new, new, jnp.asarray([0, 1, 2, 3, 12]))
    # Under a trace, negative slots are padding and out-of-range rows are dropped, never wrapped.
    out, _ = jax.jit(write_kv)(k, k, new + 1.0, new, jnp.asarray([-1, -5, 0, 11, 99]))
    written = np.asarray(out)
    assert written[:, 0, 0].tolist() == [[1.0] * 8] * 2
    assert written[:, 2, 3].tolist() == [[1.0] * 8] * 2
    assert written.sum() == 2 * 2 * 8
