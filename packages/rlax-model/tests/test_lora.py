"""LoRA adapters (`rlax_model.lora`): checked against an independent dense computation of
W + (alpha / r) * A @ B, forward and backward, in float64 numpy where it matters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlax_model
from rlax_core.config import LoraConfig
from rlax_model import lora

CONFIG = rlax_model.ModelConfig.tiny(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8
)
TOKENS = np.array([[3, 17, 9, 41, 5, 22, 8, 30], [12, 6, 50, 2, 33, 7, 19, 44]], np.int32)
POSITIONS = np.tile(np.arange(TOKENS.shape[1], dtype=np.int32), (2, 1))


def logits(params):
    out, _ = rlax_model.forward(params, TOKENS, POSITIONS, config=CONFIG)
    return out


@pytest.fixture(scope="module")
def base():
    return rlax_model.init_params(CONFIG, jax.random.key(0), std=0.2)


def trained(adapters, key):
    """Adapters with B moved off zero (as after training), so that the checks see them."""
    keys = jax.random.split(key, len(adapters))
    return {
        name: {"a": ad["a"], "b": 0.3 * jax.random.normal(k, ad["b"].shape, jnp.float32)}
        for k, (name, ad) in zip(keys, adapters.items(), strict=True)
    }


def dense_reference(base, adapters, scale):
    """W + scale * A @ B for every target, in float64 numpy, rounded once to float32."""
    layers = dict(base["layers"])
    for name, ad in adapters.items():
        w = np.asarray(layers[name], np.float64)
        delta = np.einsum("lir,lro->lio", np.asarray(ad["a"], np.float64), np.asarray(ad["b"], np.float64))
        layers[name] = jnp.asarray((w + scale * delta).astype(np.float32))
    return {**base, "layers": layers}


def test_targets_expand_groups_in_the_decoders_order_and_bad_configs_are_named():
    assert LoraConfig().target_names() == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert LoraConfig(targets=("mlp", "q_proj")).target_names() == (
        "q_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert LoraConfig(rank=8, alpha=16).scale == 2.0
    for bad, field in (({"rank": 0}, "rank"), ({"alpha": -1.0}, "alpha"), ({"targets": ("qproj",)}, "targets"),
                       ({"targets": ()}, "targets")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            LoraConfig(**bad)


def test_shapes_and_a_fresh_adapter_gives_the_base_model_to_the_bit(base):
    cfg = LoraConfig(rank=4, alpha=8.0)
    adapters = lora.init_adapters(CONFIG, cfg, jax.random.key(1))
    assert adapters["q_proj"]["a"].shape == (2, 32, 4) and adapters["q_proj"]["b"].shape == (2, 4, 32)
    assert adapters["k_proj"]["b"].shape == (2, 4, 16) and adapters["down_proj"]["a"].shape == (2, 48, 4)
    assert float(jnp.abs(adapters["up_proj"]["a"]).max()) <= 1 / np.sqrt(32)
    assert float(jnp.abs(adapters["up_proj"]["a"]).max()) > 0
    # 7 targets x 2 layers x (in + out) x r float32 values.
    per_layer = sum(s["a"][1] + s["b"][2] for s in lora.adapter_shapes(CONFIG, cfg).values())
    assert lora.adapter_bytes(adapters) == 2 * per_layer * 4 * 4
    np.testing.assert_array_equal(logits(lora.with_adapters(base, adapters, cfg.scale)), logits(base))


@pytest.mark.parametrize("targets", [("all-linear",), ("attention",), ("mlp",)])
def test_the_unmerged_and_merged_forward_match_the_dense_computation(base, targets):
    cfg = LoraConfig(rank=4, alpha=8.0, targets=targets)
    adapters = trained(lora.init_adapters(CONFIG, cfg, jax.random.key(2)), jax.random.key(3))
    reference = logits(dense_reference(base, adapters, cfg.scale))
    unmerged = logits(lora.with_adapters(base, adapters, cfg.scale))
    merged = logits(lora.merge_adapters(base, adapters, cfg.scale))
    # The adapters move the outputs by far more than the tolerance: the check can fail.
    assert float(jnp.abs(reference - logits(base)).max()) > 0.05
    np.testing.assert_allclose(unmerged, reference, rtol=0, atol=2e-5)
    np.testing.assert_allclose(merged, reference, rtol=0, atol=2e-5)
    assert "lora" not in lora.merge_adapters(base, adapters, cfg.scale)["layers"]


def test_the_adapters_gradients_are_the_dense_weights_gradient_through_the_low_rank_map(base):
    """d/dA and d/dB of a loss through the adapter path equal scale * dW @ B^T and
    scale * A^T @ dW, where dW is the dense model's gradient at W + scale * A @ B."""
    cfg = LoraConfig(rank=3, alpha=6.0, targets=("q_proj", "down_proj"))
    adapters = trained(lora.init_adapters(CONFIG, cfg, jax.random.key(4)), jax.random.key(5))
    weights = jax.random.normal(jax.random.key(6), (2, TOKENS.shape[1], CONFIG.vocab_size))

    def loss_of_adapters(ads):
        return jnp.sum(weights * jax.nn.log_softmax(logits(lora.with_adapters(base, ads, cfg.scale))))

    def loss_of_params(params):
        return jnp.sum(weights * jax.nn.log_softmax(logits(params)))

    grads = jax.grad(loss_of_adapters)(adapters)
    dense_grads = jax.grad(loss_of_params)(dense_reference(base, adapters, cfg.scale))["layers"]
    for name, ad in adapters.items():
        dw = np.asarray(dense_grads[name], np.float64)
        a, b = np.asarray(ad["a"], np.float64), np.asarray(ad["b"], np.float64)
        want_a = cfg.scale * np.einsum("lio,lro->lir", dw, b)
        want_b = cfg.scale * np.einsum("lir,lio->lro", a, dw)
        assert np.abs(want_a).max() > 1e-2 and np.abs(want_b).max() > 1e-2
        np.testing.assert_allclose(grads[name]["a"], want_a, rtol=0, atol=2e-4 * np.abs(want_a).max())
        np.testing.assert_allclose(grads[name]["b"], want_b, rtol=0, atol=2e-4 * np.abs(want_b).max())


def test_adapters_that_do_not_fit_the_model_are_refused_naming_the_layer(base):
    cfg = LoraConfig(rank=2, targets=("k_proj",))
    adapters = lora.init_adapters(CONFIG, cfg, jax.random.key(7))
    wrong = {"k_proj": {"a": adapters["k_proj"]["a"], "b": jnp.zeros((2, 2, 32))}}
    with pytest.raises(ValueError, match="k_proj.*do not fit the weight"):
        lora.with_adapters(base, wrong, cfg.scale)
    with pytest.raises(ValueError, match="'w_proj': the model has no such linear layer"):
        lora.merge_adapters(base, {"w_proj": adapters["k_proj"]}, cfg.scale)
