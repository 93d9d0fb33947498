"""A complete HF folder (`save_hf_folder`): transformers loads it as it is and agrees with
RLAX on token ids, chat rendering and greedy output."""

from __future__ import annotations

import json

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers
from rlax_model_greedy import greedy_generate

from rlax_core.gguf_file import GGUFFile
from rlax_core.testing import CHATML, tiny_bpe
from rlax_core.tokenizer import CharTokenizer, Tokenizer
from rlax_model import ModelConfig, init_params
from rlax_model.checkpoint_hf import CheckpointError, load_hf_checkpoint
from rlax_model.hf_export import gguf_sampling_defaults, save_hf_folder

TEXTS = ["12+34=46", "what is 7*8? 56.", "<bos>1-1=0<eos><pad>", "(2+3)*4 = 20"]
MESSAGES = [[{"role": "user", "content": "3+4="}], [{"role": "user", "content": "(9-2)*3="}]]


def _bpe() -> Tokenizer:
    # Specials first: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2, as the char ids go.
    return Tokenizer(
        tiny_bpe(),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


@pytest.fixture(scope="module", params=["char", "bpe"])
def tiny_folder(request, tmp_path_factory):
    tokenizer = CharTokenizer() if request.param == "char" else _bpe()
    # bos/eos left unset in the model config: the export takes them from the tokenizer.
    config = ModelConfig.tiny(vocab_size=320, bos_token_id=None, eos_token_id=None)
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(3), std=0.4))
    out = tmp_path_factory.mktemp("export") / "hf"
    save_hf_folder(out, config, params, tokenizer)
    return out, config, params, tokenizer


def test_tiny_folder_loads_with_auto_classes_and_matches_rlax(tiny_folder):
    out, config, params, ours = tiny_folder
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert theirs(text).input_ids == ours.encode(text), text
        assert theirs.decode(ours.encode(text)) == text
    for messages in MESSAGES:
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == ours.render_chat(messages)
        assert theirs(rendered).input_ids == ours.apply_chat_template(messages)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 0)
    assert theirs.model_max_length == config.max_position_embeddings

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 0)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)
    prompts = [ours.apply_chat_template(m) for m in MESSAGES]
    rlax = greedy_generate(params, config, prompts, 12)
    for prompt, row in zip(prompts, rlax, strict=True):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        want = row.tolist()
        if ours.eos_id in want:  # generate() stops at EOS, as generation_config.json tells it
            want = want[: want.index(ours.eos_id) + 1]
        assert hf[0, len(prompt) :].tolist() == want


def test_export_replaces_whole_folder_and_leaves_nothing_half_written(tiny_folder, tmp_path):
    _, config, params, tokenizer = tiny_folder
    out = tmp_path / "hf"
    save_hf_folder(out, config, params, tokenizer)
    (out / "stale.bin").write_bytes(b"from an earlier export")
    save_hf_folder(out, config, params, tokenizer)
    assert not (out / "stale.bin").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temp or old folder left

    # A failing export (tokenizer larger than the model's vocabulary) keeps the old folder.
    small = ModelConfig.tiny(vocab_size=tokenizer.vocab_size - 1)
    with pytest.raises(CheckpointError, match="tokenizer has"):
        save_hf_folder(out, small, jax.tree.map(np.asarray, init_params(small, jax.random.key(0))), tokenizer)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert load_hf_checkpoint(out)[0].vocab_size == config.vocab_size

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("not an HF folder")
    with pytest.raises(CheckpointError, match="refusing"):
        save_hf_folder(other, config, params, tokenizer)
    assert (other / "keep.txt").exists()


def test_gguf_sampling_defaults_go_to_generation_config(tiny_folder, tmp_path):
    _, config, params, tokenizer = tiny_folder
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    w.add_float32("general.sampling.temp", 0.5)
    w.add_int32("general.sampling.top_k", 20)
    w.add_float32("general.sampling.top_p", 0.75)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sampling = gguf_sampling_defaults(GGUFFile(tmp_path / "s.gguf"))
    assert sampling == {"temperature": 0.5, "top_k": 20, "top_p": 0.75, "do_sample": True}
    save_hf_folder(tmp_path / "hf", config, params, tokenizer, sampling=sampling)
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (gen.temperature, gen.top_k, gen.top_p, gen.do_sample) == (0.5, 20, 0.75, True)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 2
