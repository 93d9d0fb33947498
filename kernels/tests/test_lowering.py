"""The kernels lower for real targets (Mosaic for TPU, Triton IR for CUDA) without the hardware.

Interpret mode checks the arithmetic but not the target's rules (Triton's power-of-two
tiles, Mosaic's supported ops and layouts at lowering time). Lowering with
``lowering_platforms`` runs the real Pallas lowering passes on the CPU; compiling the
result still needs the device and is not done here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from rlax_kernels.paged_attention.ops import _attention_rows, _knobs

CASES = [
    # (batch, chunk, group, num_kv_heads, head_dim, page_size, dtype)
    (3, 1, 1, 2, 64, 16, jnp.float32),
    (3, 1, 8, 1, 128, 16, jnp.bfloat16),
    (2, 1, 4, 2, 128, 32, jnp.bfloat16),
    (2, 16, 4, 2, 64, 16, jnp.bfloat16),  # prefill chunk: several row blocks
]


def _lowered(
    backend: str, platform: str, case, sliding_window: int | None = None, engine_decode: bool = False
) -> str:
    """Lower `case`; `engine_decode`: as the engine decodes (5-D cache, traced layer, new K/V)."""
    batch, chunk, group, kv_heads, head_dim, page_size, dtype = case
    max_pages, total_pages = 7, 40
    layers = (3,) if engine_decode else ()
    ppb, rows = _knobs(
        "test", backend, chunk * group, page_size, head_dim, max_pages, 2, None, jnp.dtype(dtype).itemsize
    )
    shapes = (
        jax.ShapeDtypeStruct((batch, chunk, group * kv_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((*layers, kv_heads, total_pages, page_size, head_dim), dtype),
        jax.ShapeDtypeStruct((*layers, kv_heads, total_pages, page_size, head_dim), dtype),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
    )
    extras = {}
    if engine_decode:
        new = jax.ShapeDtypeStruct((batch, kv_heads, head_dim), dtype)
        extras = {"layer": jax.ShapeDtypeStruct((), jnp.int32), "new_k": new, "new_v": new}
    traced = _attention_rows.trace(
        *shapes, backend=backend, scale=0.125, pages_per_block=ppb, block_rows=rows, interpret=False,
        sliding_window=sliding_window, **extras,
    )  # fmt: skip
    return traced.lower(lowering_platforms=(platform,)).as_text()


ENGINE_DECODE = [(c, w, True) for c in CASES if c[1] == 1 for w in (None, 20)]
GRID = [(c, w, False) for c in CASES for w in (None, 20)] + ENGINE_DECODE
IDS = [f"b{c[0]}-c{c[1]}-g{c[2]}-d{c[4]}-p{c[5]}-w{w}{'-engine' if e else ''}" for c, w, e in GRID]


@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("case,sliding_window,engine_decode", GRID, ids=IDS)
def test_tpu_kernel_lowers_to_mosaic(device_kind: str, case, sliding_window, engine_decode) -> None:
    # Mosaic lowering asks the current device for its generation; describe a TPU abstractly.
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        text = _lowered("pallas_tpu", "tpu", case, sliding_window, engine_decode)
    assert re.findall(r"custom_call @(\S+)\(", text) == ["tpu_custom_call"]


@pytest.mark.parametrize("case,sliding_window,engine_decode", GRID, ids=IDS)
def test_gpu_kernel_lowers_to_triton(case, sliding_window, engine_decode) -> None:
    text = _lowered("pallas_gpu", "cuda", case, sliding_window, engine_decode)
    assert re.findall(r"custom_call @(\S+)\(", text) == ["__gpu$xla.gpu.triton"]


def test_triton_lowering_rejects_a_non_power_of_two_block() -> None:
    """The check that `_knobs` enforces eagerly is a real constraint of the Triton lowering."""
    shapes = (
        jax.ShapeDtypeStruct((1, 1, 4, 64), jnp.float32),
        jax.ShapeDtypeStruct((1, 8, 16, 64), jnp.float32),
        jax.ShapeDtypeStruct((1, 8, 16, 64), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1, 6), jnp.int32),
    )
    traced = _attention_rows.trace(
        *shapes, backend="pallas_gpu", scale=0.125, pages_per_block=3, block_rows=16, interpret=False
    )
    with pytest.raises(Exception, match="power of 2"):
        traced.lower(lowering_platforms=("cuda",))
