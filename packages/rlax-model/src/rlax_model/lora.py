"""LoRA: low-rank adapters on the decoder's linear layers, unmerged or merged into the base.

A target W [in, out] (stacked [L, in, out] over the layers) computes

    x @ W + scale * (x @ A) @ B,    A [in, r], B [r, out], scale = alpha / r

(`rlax_core.config.LoraConfig`). Adapters are their own pytree, `Adapters`:

    <name>/a  [L, in, r]   float32, uniform in +-1/sqrt(in) (PEFT's Kaiming-uniform default)
    <name>/b  [L, r, out]  float32, zero: a fresh adapter leaves the base model unchanged

Two ways to run them:
- unmerged, `with_adapters(params, adapters, scale)`: the forward applies each adapter as
  the low-rank path (`layers.project`); gradients reach only A and B, and the trainer never
  forms a full weight's gradient.
- merged, `merge_adapters(params, adapters, scale)`: W + scale * A @ B per target, a plain
  parameter tree: decoding costs what the base costs.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from rlax_core.config import LoraConfig
from rlax_model.config import ModelConfig
from rlax_model.transformer import Params, param_shapes

Adapters = dict[str, dict[str, jax.Array]]

__all__ = [
    "Adapters",
    "LoraConfig",
    "adapter_bytes",
    "adapter_shapes",
    "init_adapters",
    "merge_adapters",
    "with_adapters",
]


def adapter_shapes(config: ModelConfig, lora: LoraConfig) -> dict[str, dict[str, tuple[int, int, int]]]:
    """name -> {"a": (L, in, r), "b": (L, r, out)} for every target of `lora`."""
    layers = param_shapes(config)["layers"]
    shapes = {}
    for name in lora.target_names():
        n, fan_in, fan_out = layers[name]
        shapes[name] = {"a": (n, fan_in, lora.rank), "b": (n, lora.rank, fan_out)}
    return shapes


def init_adapters(config: ModelConfig, lora: LoraConfig, key: jax.Array) -> Adapters:
    """Fresh adapters: A uniform in +-1/sqrt(in), B zero (the model's outputs are the base's
    to the bit: the adapter adds scale * (x @ A) @ 0 = 0). All float32."""
    shapes = adapter_shapes(config, lora)
    keys = jax.random.split(key, len(shapes))
    adapters: Adapters = {}
    for k, (name, shape) in zip(keys, shapes.items(), strict=True):
        bound = 1.0 / math.sqrt(shape["a"][1])
        adapters[name] = {
            "a": jax.random.uniform(k, shape["a"], jnp.float32, -bound, bound),
            "b": jnp.zeros(shape["b"], jnp.float32),
        }
    return adapters


def _check(params: Params, adapters: Adapters) -> None:
    layers = params["layers"]
    for name, adapter in adapters.items():
        if name not in layers:
            raise ValueError(f"adapter for {name!r}: the model has no such linear layer")
        n, fan_in, fan_out = layers[name].shape
        a, b = adapter["a"].shape, adapter["b"].shape
        if len(a) != 3 or len(b) != 3 or a[:2] != (n, fan_in) or b[0] != n or b[2] != fan_out or a[2] != b[1]:
            raise ValueError(
                f"adapter for {name!r}: a {a} and b {b} do not fit the weight {layers[name].shape} "
                "(expected a [L, in, r] and b [L, r, out])"
            )


def with_adapters(params: Params, adapters: Adapters, scale: float) -> Params:
    """`params` with the adapters attached unmerged (`layers/lora/<name>/{a, b}`, b already
    multiplied by `scale`: no extra leaf, and a cast of the tree to a 16-bit compute dtype
    cannot round the scale apart from B); the base's arrays are shared, not copied. The
    forward then computes every target with its low-rank path (`layers.project`);
    differentiating through this function gives the adapters' own gradients."""
    _check(params, adapters)
    lora = {
        name: {"a": adapter["a"], "b": adapter["b"] * jnp.asarray(scale, adapter["b"].dtype)}
        for name, adapter in adapters.items()
    }
    return {**params, "layers": {**params["layers"], "lora": lora}}


def merge_adapters(params: Params, adapters: Adapters, scale: float) -> Params:
    """A plain parameter tree: every target W becomes W + scale * A @ B, computed in float32
    and rounded once to W's dtype. Other arrays are shared, not copied."""
    _check(params, adapters)
    layers = dict(params["layers"])
    for name, adapter in adapters.items():
        delta = jnp.einsum("lir,lro->lio", adapter["a"], adapter["b"], precision=jax.lax.Precision.HIGHEST)
        w = layers[name]
        layers[name] = (w.astype(jnp.float32) + jnp.float32(scale) * delta).astype(w.dtype)
    return {**params, "layers": layers}


def adapter_bytes(adapters: Any) -> int:
    """The adapters' size in bytes (what a version of a LoRA run carries)."""
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(adapters)))
