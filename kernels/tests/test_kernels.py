"""The Pallas TPU and GPU kernels (interpret mode on the CPU) against the reference over a grid.

Every case plants NaN in unused pages, in the unused tail of each last page and in
padding query rows, and points unused block-table entries at NaN pages or far outside the
cache: any read or weight that should not happen turns the output into NaN or, in TPU
interpret mode, an out-of-bounds error.

The CPU decode paths -- the XLA one (a few pages at a time, two passes around one exact
softmax) and the native kernel (numba through XLA's FFI, what the CPU engine runs) -- get
the same grid (float32 for the native kernel, which reads float32 caches) and poison, plus
the engine's extras (the newest token's K/V beside the cache, pages read through a layer axis).

The default grid covers every value of each axis (batch 1-8, 1/4/8 query heads per KV
head, head_dim 64/128, page size 16/32, float32/bfloat16, lengths of 1, exact page
multiples and ragged, several compute-block widths); the full cross product is `slow`.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_kernels import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_reference,
    paged_attention_xla,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    write_kv,
)
from rlax_kernels.paged_attention.testing import make_paged_case
from rlax_kernels.paged_attention.xla import _pages_per_step

BACKENDS = ["pallas_tpu", "pallas_gpu"]
# float32 kernels accumulate exactly like the reference up to summation order; bfloat16
# kernels feed bfloat16 probabilities to the second matmul and round the output.
TOLERANCE = {"float32": {"rtol": 1e-5, "atol": 1e-5}, "bfloat16": {"rtol": 1e-2, "atol": 1e-2}}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _lengths(kind: str, batch: int, page_size: int) -> list[int]:
    if kind == "one":
        return [1] * batch
    if kind == "pages":
        return [page_size * (1 + b % 3) for b in range(batch)]
    if kind == "ragged":
        return [page_size * (b % 3) + 5 + 3 * b for b in range(batch)]
    # mixed: lengths of 1, exact multiples and ragged in one batch
    cycle = [
        1,
        page_size,
        2 * page_size + 5,
        3 * page_size,
        page_size - 3,
        4 * page_size + 1,
        2 * page_size,
        1,
    ]
    return [cycle[b % len(cycle)] for b in range(batch)]


def _check_decode(
    backend, batch, group, num_kv_heads, head_dim, page_size, dtype, kind, pages_per_block, seed=0
):
    case = make_paged_case(
        seed,
        seq_lens=_lengths(kind, batch, page_size),
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=DTYPES[dtype],
    )
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.block_tables)
    out = paged_attention(*args, backend=backend, interpret=True, pages_per_compute_block=pages_per_block)
    ref = paged_attention_reference(*args)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), "poison from an unused slot reached the output"
    np.testing.assert_allclose(out32, ref32, **TOLERANCE[dtype])


# (batch, group, num_kv_heads, head_dim, page_size, dtype, lengths, pages_per_compute_block)
DECODE_GRID = [
    (1, 1, 2, 64, 16, "float32", "one", 1),
    (1, 4, 1, 128, 32, "bfloat16", "ragged", 2),
    (1, 8, 1, 64, 32, "float32", "pages", 1),
    (3, 4, 2, 64, 16, "float32", "mixed", 2),
    (3, 8, 1, 128, 16, "bfloat16", "mixed", 4),
    (8, 1, 2, 128, 32, "float32", "mixed", 2),
    (8, 8, 1, 64, 16, "bfloat16", "mixed", 2),
    (5, 4, 2, 128, 32, "float32", "pages", None),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "batch,group,num_kv_heads,head_dim,page_size,dtype,kind,pages_per_block",
    DECODE_GRID,
    ids=[f"b{c[0]}-g{c[1]}-kv{c[2]}-d{c[3]}-p{c[4]}-{c[5]}-{c[6]}-ppb{c[7]}" for c in DECODE_GRID],
)
def test_decode_kernel_matches_reference(
    backend, batch, group, num_kv_heads, head_dim, page_size, dtype, kind, pages_per_block
) -> None:
    _check_decode(backend, batch, group, num_kv_heads, head_dim, page_size, dtype, kind, pages_per_block)


FULL_GRID = list(
    itertools.product(
        BACKENDS, [1, 3, 8], [1, 4, 8], [64, 128], [16, 32], ["float32", "bfloat16"], ["mixed", "one"]
    )
)


@pytest.mark.slow
@pytest.mark.parametrize("backend,batch,group,head_dim,page_size,dtype,kind", FULL_GRID)
def test_decode_kernel_full_grid(backend, batch, group, head_dim, page_size, dtype, kind) -> None:
    _check_decode(backend, batch, group, 2, head_dim, page_size, dtype, kind, 2, seed=batch * 100 + group)


# (batch, group, num_kv_heads, head_dim, page_size, dtype, chunk, seq_lens, q_lens, block_rows)
PREFILL_GRID = [
    # whole prompts, one chunk each (one of them shorter than the chunk)
    (2, 4, 2, 64, 16, "float32", 8, [8, 5], [8, 5], None),
    # chunks after a cached prefix, a decode row (q_len 1) and an idle row (q_len 0) together
    (4, 2, 2, 128, 32, "bfloat16", 8, [40, 70, 9, 33], [8, 3, 1, 0], None),
    # several row blocks per sequence, chunk boundary inside a page
    (2, 8, 1, 64, 16, "float32", 8, [21, 64], [8, 6], 16),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "batch,group,num_kv_heads,head_dim,page_size,dtype,chunk,seq_lens,q_lens,block_rows", PREFILL_GRID
)
def test_prefill_kernel_matches_reference(
    backend, batch, group, num_kv_heads, head_dim, page_size, dtype, chunk, seq_lens, q_lens, block_rows
) -> None:
    case = make_paged_case(
        1,
        seq_lens=seq_lens,
        q_lens=q_lens,
        chunk=chunk,
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=DTYPES[dtype],
    )
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.q_lens, case.block_tables)
    out = paged_prefill_attention(
        *args, backend=backend, interpret=True, pages_per_compute_block=1, block_rows=block_rows
    )
    ref = paged_prefill_attention_reference(*args)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), "poison from an unused slot or padding row reached the output"
    np.testing.assert_allclose(out32, ref32, **TOLERANCE[dtype])
    for b, q_len in enumerate(q_lens):
        assert not out32[b, q_len:].any(), "padding rows must be zero"


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_of_one_token_equals_decode(backend: str) -> None:
    case = make_paged_case(
        5, seq_lens=[17, 1, 48], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, chunk=1
    )
    prefill = paged_prefill_attention(
        case.q,
        case.k_pages,
        case.v_pages,
        case.seq_lens,
        case.q_lens,
        case.block_tables,
        backend=backend,
        interpret=True,
    )
    decode = paged_attention(
        case.q[:, 0],
        case.k_pages,
        case.v_pages,
        case.seq_lens,
        case.block_tables,
        backend=backend,
        interpret=True,
    )
    np.testing.assert_allclose(np.asarray(prefill[:, 0]), np.asarray(decode), rtol=1e-6, atol=1e-6)


# -- the CPU decode paths (XLA and the native kernel) ------------------------------------
CPU_GRID = [("xla", *c[:7]) for c in DECODE_GRID] + [
    ("cpu", *c[:7]) for c in DECODE_GRID if c[5] == "float32"
]
CPU_PATHS = {"xla": paged_attention_xla, "cpu": paged_attention_cpu}


@pytest.mark.parametrize(
    "backend,batch,group,num_kv_heads,head_dim,page_size,dtype,kind",
    CPU_GRID,
    ids=[f"{c[0]}-b{c[1]}-g{c[2]}-kv{c[3]}-d{c[4]}-p{c[5]}-{c[6]}-{c[7]}" for c in CPU_GRID],
)
def test_cpu_decode_paths_match_reference(
    backend, batch, group, num_kv_heads, head_dim, page_size, dtype, kind
):
    case = make_paged_case(
        7,
        seq_lens=_lengths(kind, batch, page_size),
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=DTYPES[dtype],
        extra_table_columns=5,  # several loop steps past the longest sequence
    )
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.block_tables)
    out = paged_attention(*args, backend=backend)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    out32 = np.asarray(out, np.float32)
    assert np.isfinite(out32).all(), "poison from an unused slot reached the output"
    np.testing.assert_allclose(
        out32, np.asarray(paged_attention_reference(*args), np.float32), **TOLERANCE[dtype]
    )


def _attend_beside(path):  # type: ignore[no-untyped-def]
    if path in CPU_PATHS:
        return jax.jit(CPU_PATHS[path])
    return lambda *args, **kw: paged_attention(*args, backend=path, interpret=True, **kw)


@pytest.mark.parametrize(
    "path", [*sorted(CPU_PATHS), "pallas_gpu", pytest.param("pallas_tpu", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("layer_axis", [False, True])
def test_newest_token_beside_the_cache_equals_writing_it_first(path, layer_axis):
    """Attending to (cache + new K/V) equals writing the token with write_kv and attending to the cache."""
    page_size, lengths = 16, [1, 16, 33, 64, 5]
    case = make_paged_case(
        3, seq_lens=lengths, num_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size, spare_pages=8
    )
    rng = np.random.default_rng(0)
    new_k = jnp.asarray(rng.normal(size=(len(lengths), 2, 64)), jnp.float32)
    new_v = jnp.asarray(rng.normal(size=(len(lengths), 2, 64)), jnp.float32)
    # Cached tokens are all but the last of each sequence; the last slot is where the new token goes.
    cached = case.seq_lens - 1
    tables = np.asarray(case.block_tables)
    last = np.asarray(cached)
    slots = jnp.asarray(tables[np.arange(len(lengths)), last // page_size] * page_size + last % page_size)
    k_written, v_written = write_kv(case.k_pages, case.v_pages, new_k, new_v, slots)
    expected = paged_attention_reference(case.q, k_written, v_written, case.seq_lens, case.block_tables)

    k_pages, v_pages, layer = case.k_pages, case.v_pages, None
    if layer_axis:  # the engine's cache: [layers, kv_heads, pages, page_size, head_dim]
        k_pages = jnp.stack([jnp.full_like(case.k_pages, jnp.nan), case.k_pages])
        v_pages = jnp.stack([jnp.full_like(case.v_pages, jnp.nan), case.v_pages])
        layer = jnp.int32(1)
    out = _attend_beside(path)(
        case.q, k_pages, v_pages, cached, case.block_tables, new_k=new_k, new_v=new_v, layer=layer
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", sorted(CPU_PATHS))
def test_only_the_new_token_when_nothing_is_cached(path):
    q = jnp.ones((2, 4, 8))
    pages = jnp.full((2, 3, 4, 8), jnp.nan)
    new_v = jnp.arange(2 * 2 * 8, dtype=jnp.float32).reshape(2, 2, 8)
    out = _attend_beside(path)(
        q,
        pages,
        pages,
        jnp.zeros(2, jnp.int32),
        jnp.zeros((2, 2), jnp.int32),
        new_k=jnp.ones((2, 2, 8)),
        new_v=new_v,
    )
    # One key: softmax weight 1 on it, so each query head returns its KV head's value.
    np.testing.assert_array_equal(np.asarray(out), np.repeat(np.asarray(new_v), 2, axis=1))


@pytest.mark.parametrize("path", sorted(CPU_PATHS))
def test_bad_arguments_name_the_problem(path):
    attend = CPU_PATHS[path]
    q, pages = jnp.ones((1, 2, 8)), jnp.ones((1, 2, 4, 8))
    lengths, tables = jnp.ones(1, jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="layer"):
        attend(q, pages, pages, lengths, tables, layer=0)
    with pytest.raises(ValueError, match="layer"):
        attend(q, pages[None], pages[None], lengths, tables)
    with pytest.raises(ValueError, match="together"):
        attend(q, pages, pages, lengths, tables, new_k=jnp.ones((1, 1, 8)))


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"q": jnp.ones((2, 4, 16))}, "q's head_dim"),
        ({"q": jnp.ones((2, 3, 8))}, "multiple of num_kv_heads"),
        ({"q": jnp.ones((2, 4))}, "q must be"),
        ({"lengths": jnp.ones(3, jnp.int32)}, "lengths must be"),
        ({"lengths": jnp.ones(2, jnp.float32)}, "lengths must be"),
        ({"block_tables": jnp.zeros((3, 2), jnp.int32)}, "block_tables must be"),
        ({"v_pages": jnp.ones((2, 5, 4, 8))}, "v_pages must have the shape of k_pages"),
        ({"new_k": jnp.ones((2, 1, 8)), "new_v": jnp.ones((2, 1, 8))}, "new_k and new_v must be"),
    ],
)
def test_cpu_kernel_rejects_inconsistent_shapes(change, needle):
    """The native kernel reads raw memory by these shapes, so each mismatch must fail before it runs."""
    args = {
        "q": jnp.ones((2, 4, 8)),
        "k_pages": jnp.ones((2, 3, 4, 8)),
        "v_pages": jnp.ones((2, 3, 4, 8)),
        "lengths": jnp.ones(2, jnp.int32),
        "block_tables": jnp.zeros((2, 2), jnp.int32),
    }
    with pytest.raises(ValueError, match=needle):
        paged_attention_cpu(**{**args, **change})


def test_cpu_kernel_reads_float32_pages_only():
    q, pages = jnp.ones((1, 2, 8), jnp.bfloat16), jnp.ones((1, 2, 4, 8), jnp.bfloat16)
    lengths, tables = jnp.ones(1, jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="float32"):
        paged_attention_cpu(q, pages, pages, lengths, tables)
    with pytest.raises(ValueError, match="float32 cache"):
        paged_attention(q, pages, pages, lengths, tables, backend="cpu")
    # "auto" on the CPU takes the XLA path for a bfloat16 cache instead.
    out = paged_attention(q, pages, pages, lengths, tables)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)


def test_cpu_kernel_never_reads_outside_the_cache():
    """Table entries outside the cache read page 0 and lengths past the table are clipped to it."""
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)
    tables = jnp.asarray([[1, 1 << 30], [-7, 2], [3, 4]], jnp.int32)
    out = paged_attention_cpu(q, k, v, jnp.asarray([6, 8, 1000], jnp.int32), tables)
    clamped = jnp.asarray([[1, 0], [0, 2], [3, 4]], jnp.int32)
    expected = paged_attention_reference(q, k, v, jnp.asarray([6, 8, 8], jnp.int32), clamped)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_cpu_kernel_exp_is_accurate_over_the_softmax_range():
    """The kernel's vectorisable exp (a polynomial, not libm) is within 2e-7 relative of float64 exp."""
    import numba

    from rlax_kernels.paged_attention.cpu import _exp

    @numba.njit
    def exp_all(x):  # type: ignore[no-untyped-def]
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = _exp(x[i])
        return out

    x = np.concatenate([np.linspace(-87.0, 0.0, 1_000_001), -np.geomspace(1e-30, 1.0, 1000), [0.0]])
    x = x.astype(np.float32)
    got, exact = exp_all(x).astype(np.float64), np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 2e-7
    assert exp_all(np.asarray([-1e30, -np.inf], np.float32)).max() < 1e-37  # clamped, still ~0


@pytest.mark.parametrize(
    "width,page_size,expected", [(12, 16, 2), (7, 16, 1), (8, 8, 4), (3, 64, 1), (1, 16, 1)]
)
def test_pages_per_step_divides_the_table(width, page_size, expected):
    assert _pages_per_step(width, page_size) == expected


def test_cpu_kernel_takes_launches_from_several_threads_at_once():
    """Concurrent programs (here four Python threads) each get the right answer: the handler
    serialises launches, which numba's workqueue threading layer cannot take two of at once."""
    import threading

    case = make_paged_case(
        0, seq_lens=[5, 40, 17, 64] * 8, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, poison=False
    )
    args = (case.q, case.k_pages, case.v_pages, case.seq_lens, case.block_tables)
    attend = jax.jit(paged_attention_cpu)
    expected = np.asarray(paged_attention_reference(*args))
    wrong: list[float] = []

    def run() -> None:
        for _ in range(50):
            error = float(np.abs(np.asarray(attend(*args)) - expected).max())
            if error > 1e-5:
                wrong.append(error)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
