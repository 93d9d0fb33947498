"""GGUF import: synthetic files written with `gguf`, the real SmolLM2 file, and parity with
transformers' own GGUF loader."""

from __future__ import annotations

import json
import pathlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from rlax_core.gguf_file import GGUFError, GGUFFile, find_smollm2_gguf
from rlax_core.tokenizer import Tokenizer
from rlax_model import ModelConfig, forward, init_params
from rlax_model.gguf_import import gguf_config, load_gguf, unpermute_rope_rows

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # The row order llama.cpp's HF->GGUF converter writes for Q/K: per head, the two rotary
    # halves interleaved (row j of half 0, row j of half 1, ...).
    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(d // 2):
            out[h * d + 2 * j] = w[h * d + j]
            out[h * d + 2 * j + 1] = w[h * d + d // 2 + j]
    return out


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 3):
        np.testing.assert_array_equal(unpermute_rope_rows(_llama_cpp_permute(w, heads), heads), w)
    with pytest.raises(GGUFError, match="not a multiple of 2 \\* 5 heads"):
        unpermute_rope_rows(w, 5)


def _write_tiny_gguf(
    path: pathlib.Path, config: ModelConfig, params, *, arch: str = "llama", drop: str | None = None
):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.head_dim)
    w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    tensors = {"token_embd.weight": params["embed"], "output_norm.weight": params["final_norm"]}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = params["lm_head"].T
    names = {
        "attn_norm": "attn_norm",
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "mlp_norm": "ffn_norm",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
    }
    for i in range(config.num_layers):
        for ours, theirs in names.items():
            x = np.asarray(params["layers"][ours][i])
            if ours.endswith("proj"):
                x = x.T
            if ours == "q_proj":
                x = _llama_cpp_permute(x, config.num_heads)
            if ours == "k_proj":
                x = _llama_cpp_permute(x, config.num_kv_heads)
            tensors[f"blk.{i}.{theirs}.weight"] = x
    for name, x in tensors.items():
        if name != drop:
            w.add_tensor(name, np.ascontiguousarray(np.asarray(x, np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_gguf_imports_exactly(tmp_path, tied):
    config = ModelConfig.tiny(tie_word_embeddings=tied, rms_norm_eps=1e-5, rope_theta=100000.0)
    params = init_params(config, jax.random.key(0), std=0.3)
    _write_tiny_gguf(tmp_path / "m.gguf", config, params)
    config2, params2 = load_gguf(tmp_path / "m.gguf")
    assert config2 == config
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = jnp.array([[3, 9, 27, 81]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(
        forward(params, tokens, pos, config=config)[0], forward(params2, tokens, pos, config=config2)[0]
    )


def test_bad_gguf_files_are_named(tmp_path):
    config = ModelConfig.tiny()
    params = init_params(config, jax.random.key(0))
    _write_tiny_gguf(tmp_path / "gpt2.gguf", config, params, arch="gpt2")
    with pytest.raises(GGUFError, match=r"general\.architecture='gpt2' is not supported"):
        load_gguf(tmp_path / "gpt2.gguf")
    _write_tiny_gguf(tmp_path / "drop.gguf", config, params, drop="blk.1.ffn_up.weight")
    with pytest.raises(GGUFError, match=r"tensor 'blk\.1\.ffn_up\.weight' is missing"):
        load_gguf(tmp_path / "drop.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        GGUFFile(tmp_path / "junk.gguf")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        GGUFFile(tmp_path / "absent.gguf")


@pytest.fixture(scope="module")
def smollm2_file():
    return GGUFFile(find_smollm2_gguf())


def test_real_smollm2_metadata_and_shapes(smollm2_file):
    file = smollm2_file
    config = gguf_config(file)
    assert config == ModelConfig.smollm2_135m(max_position_embeddings=8192)
    assert file.tensor_type("blk.0.attn_q.weight") == "Q4_1"
    assert file.tensor_type("token_embd.weight") == "Q8_0"
    assert file.tensor_shape("blk.0.attn_k.weight") == (192, 576)
    assert file.tensor_shape("blk.29.ffn_down.weight") == (576, 1536)
    assert "output.weight" not in file.tensor_names and config.tie_word_embeddings
    k = file.tensor("blk.0.attn_k.weight")
    assert k.dtype == np.float32 and np.isfinite(k).all() and k.std() > 0


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_file):
    return Tokenizer.from_gguf(smollm2_file)


# Ids produced by transformers' own GGUF tokenizer conversion (recorded once; the live
# comparison below is `slow` because that conversion takes ~30 s on 2 cores).
PINNED_IDS = {
    "Hello 12345 world!!  tabs\tand\nnewlines": [
        19556,
        216,
        33,
        34,
        35,
        36,
        37,
        905,
        10095,
        216,
        29416,
        197,
        397,
        198,
        2241,
        5110,
    ],
    "naïve café — ünïcödé 😀": [
        3546,
        46494,
        37366,
        1841,
        5549,
        137,
        94,
        25972,
        83,
        7466,
        84,
        2756,
        40303,
        218,
    ],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
}


def test_gguf_tokenizer_pinned_ids_and_chat_template(smollm2_tokenizer):
    for text, ids in PINNED_IDS.items():
        assert smollm2_tokenizer.encode(text) == ids, text
        assert smollm2_tokenizer.decode(ids) == text
    assert (
        smollm2_tokenizer.decode(PINNED_IDS["<|im_start|>user\nhi<|im_end|>"], skip_special_tokens=True)
        == "user\nhi"
    )
    text = smollm2_tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])[:2] == [1, 9690]


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(smollm2_tokenizer):
    path = find_smollm2_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [
        *PROMPTS,
        "Hello 12345 world!!  tabs\tand\nnewlines",
        "naïve café — ünïcödé 😀",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in texts:
        assert smollm2_tokenizer.encode(text) == ref(text, add_special_tokens=False).input_ids, text
        assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": PROMPTS[0]}]
    assert smollm2_tokenizer.render_chat(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert (smollm2_tokenizer.bos_id, smollm2_tokenizer.eos_id, smollm2_tokenizer.pad_id) == (1, 2, 2)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_gguf_loading(smollm2_file, smollm2_tokenizer):
    """SmolLM2-135M-Instruct from GGUF continues three chat prompts with the same 16 greedy
    tokens as transformers' own GGUF loader."""
    import torch
    from rlax_model_greedy import greedy_generate

    path = smollm2_file.path
    config, params = load_gguf(smollm2_file)
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = greedy_generate(params, config, prompts, 16)
    del params
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    for i, prompt in enumerate(prompts):
        # Plain greedy argmax for 16 steps, through <|im_end|> too (generate() would stop there).
        ids, theirs = torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(16):
                nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
                theirs.append(int(nxt[0, 0]))
        assert ours[i].tolist() == theirs, (
            PROMPTS[i],
            smollm2_tokenizer.decode(ours[i]),
            smollm2_tokenizer.decode(theirs),
        )


def test_gguf_tokenizer_exports_to_hf_files(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    for text, ids in PINNED_IDS.items():
        assert again.encode(text) == ids
    messages = [{"role": "user", "content": PROMPTS[1]}]
    assert again.apply_chat_template(messages) == smollm2_tokenizer.apply_chat_template(messages)
    assert (again.bos_id, again.eos_id, again.pad_id) == (1, 2, 2)
    # AutoTokenizer (not a named class) reads the folder as it is, specials included.
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "special_tokens_map.json").read_text()) == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
    }
    assert (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (1, 2, 2)
    for text, ids in PINNED_IDS.items():
        assert ref(text, add_special_tokens=False).input_ids == ids
    assert ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == again.render_chat(
        messages
    )
