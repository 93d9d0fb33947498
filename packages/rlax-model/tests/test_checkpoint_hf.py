"""HF checkpoints: parity with transformers, save -> load bit-exact, bad checkpoints named."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from rlax_model_hf_reference import ARCHS, hf_logits, save_hf_model
from safetensors.numpy import load_file, save_file

from rlax_model import (
    CheckpointError,
    DenseContext,
    Llama3RopeScaling,
    ModelConfig,
    forward,
    init_params,
    load_hf_checkpoint,
    positions_from_valid,
    save_hf_checkpoint,
)

jit_forward = jax.jit(forward, static_argnames=("config", "attention", "remat"))


def _padded_batch(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    lengths, seq = [11, 7, 4, 9], 11
    tokens = np.zeros((4, seq), np.int32)
    valid = np.zeros((4, seq), bool)
    for row, n in enumerate(lengths):
        # rows 0, 1 left-padded, rows 2, 3 right-padded
        sl = slice(seq - n, seq) if row < 2 else slice(0, n)
        tokens[row, sl] = rng.integers(3, vocab, n)
        valid[row, sl] = True
    return tokens, valid


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, directory)
    return request.param, directory, model


def test_logits_match_transformers(hf_checkpoint):
    arch, directory, model = hf_checkpoint
    config, params = load_hf_checkpoint(directory)
    assert config.architecture == arch
    tokens, valid = _padded_batch(config.vocab_size)
    positions = np.asarray(positions_from_valid(jnp.asarray(valid)))
    ref = hf_logits(model, tokens, valid, positions)
    got, _ = jit_forward(
        params,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        config=config,
        attention_context=DenseContext(jnp.asarray(valid)),
    )
    got = np.asarray(got)
    assert got.dtype == np.float32
    err = np.abs(got - ref)[valid].max()
    assert err < 1e-4, f"{arch}: max abs logit difference {err}"


def test_save_load_round_trip_bit_exact(hf_checkpoint, tmp_path):
    arch, directory, _ = hf_checkpoint
    config, params = load_hf_checkpoint(directory)
    for shard in (None, 20_000):
        out = tmp_path / f"shard{shard}"
        save_hf_checkpoint(out, config, params, max_shard_bytes=shard)
        assert (out / "model.safetensors.index.json").exists() == (shard is not None)
        config2, params2 = load_hf_checkpoint(out)
        assert config2 == config
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2
        )
    # Our export of the HF tensors is byte-identical to transformers' own.
    ours = load_file(str(tmp_path / "shardNone" / "model.safetensors"))
    theirs = load_file(str(directory / "model.safetensors"))
    theirs.pop("lm_head.weight", None) if config.tie_word_embeddings else None
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_saved_checkpoint_loads_in_transformers(tmp_path):

    config = ModelConfig.tiny(
        architecture="llama", rope_scaling=Llama3RopeScaling(factor=2.0, original_max_position_embeddings=32)
    )
    params = init_params(config, jax.random.key(3), std=0.3)
    save_hf_checkpoint(tmp_path, config, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens, valid = _padded_batch(config.vocab_size)
    positions = np.asarray(positions_from_valid(jnp.asarray(valid)))
    ref = hf_logits(model, tokens, valid, positions)
    got, _ = jit_forward(
        params,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        config=config,
        attention_context=DenseContext(jnp.asarray(valid)),
    )
    assert np.abs(np.asarray(got) - ref)[valid].max() < 1e-4


def test_bfloat16_round_trip_bit_exact(tmp_path):
    config = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    save_hf_checkpoint(tmp_path, config, params)
    config2, params2 = load_hf_checkpoint(tmp_path, param_dtype="bfloat16")
    assert config2 == config
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def tiny_checkpoint(tmp_path) -> pathlib.Path:
    config = ModelConfig.tiny()
    save_hf_checkpoint(tmp_path, config, init_params(config, jax.random.key(0)))
    return tmp_path


def _edit_tensors(directory: pathlib.Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _edit_config(directory: pathlib.Path, **changes) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_missing_tensor_is_named(tiny_checkpoint):
    _edit_tensors(tiny_checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_hf_checkpoint(tiny_checkpoint)


def test_misshaped_tensor_is_named(tiny_checkpoint):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    _edit_tensors(tiny_checkpoint, edit)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(31, 64\), expected \(32, 64\)",
    ):
        load_hf_checkpoint(tiny_checkpoint)


def test_unexpected_tensor_is_named(tiny_checkpoint):
    _edit_tensors(
        tiny_checkpoint,
        lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}),
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"
    ):
        load_hf_checkpoint(tiny_checkpoint)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"architectures=\['GPT2LMHeadModel'\] is not supported"),
        ({"architectures": None, "model_type": "phi"}, r"model_type='phi' is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, r"num_kv_heads=3: must divide num_heads=4"),
        ({"vocab_size": -5}, r"vocab_size=-5"),
        ({"num_hidden_layers": None}, r"'num_hidden_layers' is missing"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"rope scaling type 'yarn' is not supported",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, r"lacks field 'low_freq_factor'"),
        ({"mlp_bias": True}, r"mlp_bias=True"),
    ],
)
def test_bad_config_field_is_named(tiny_checkpoint, changes, pattern):
    _edit_config(tiny_checkpoint, **changes)
    with pytest.raises(CheckpointError, match=pattern):
        load_hf_checkpoint(tiny_checkpoint)


def test_bad_json_and_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "vocab_size": }')
    with pytest.raises(CheckpointError, match=r"config\.json:2: invalid JSON"):
        load_hf_checkpoint(tmp_path)
    config = ModelConfig.tiny()
    (tmp_path / "config.json").unlink()
    save_hf_checkpoint(tmp_path, config, init_params(config, jax.random.key(0)))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_hf_checkpoint(tmp_path)


def test_save_rejects_inconsistent_params_and_config(tmp_path):
    config = ModelConfig.tiny()
    params = init_params(config, jax.random.key(0))
    params["layers"]["q_proj"] = params["layers"]["q_proj"][:, :, :-1]
    with pytest.raises(CheckpointError, match=r"params\['layers'\]\['q_proj'\] has shape \(2, 64, 63\)"):
        save_hf_checkpoint(tmp_path, config, params)
    with pytest.raises(CheckpointError, match=r"qk_norm=True cannot be saved as architecture='llama'"):
        save_hf_checkpoint(tmp_path, config.replace(qk_norm=True), init_params(config, jax.random.key(0)))
    assert not list(tmp_path.iterdir())
