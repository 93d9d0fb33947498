"""Tokenizers: the built-in character tokenizer, the HF `tokenizers` wrapper and chat templates."""

from __future__ import annotations

import json

import pytest
import transformers

from rlax_core import (
    CharTokenizer,
    ChatTemplate,
    ChatTemplateError,
    Tokenizer,
    TokenizerError,
    TokenizerLike,
)
from rlax_core.testing import CHATML, tiny_bpe


@pytest.fixture
def hf_dir(tmp_path):
    tok = Tokenizer(
        tiny_bpe(),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
    tok.save(tmp_path)
    return tmp_path


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer()
    assert isinstance(tok, TokenizerLike)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("12+34=46", add_bos=True)
    assert ids[0] == 1 and len(ids) == 9
    assert tok.decode(ids) == "<bos>12+34=46"
    assert tok.decode(ids, skip_special_tokens=True) == "12+34=46"
    assert tok.encode("7<eos><pad>") == [tok.encode("7")[0], 2, 0]
    assert tok.vocab_size == 3 + len(tok.alphabet)
    assert tok.apply_chat_template([{"role": "user", "content": "3*3="}]) == tok.encode("<bos>3*3=")


def test_char_tokenizer_errors():
    tok = CharTokenizer("0123456789+=")
    with pytest.raises(TokenizerError, match=r"character 'x' at index 2 is not in the alphabet"):
        tok.encode("1+x")
    with pytest.raises(TokenizerError, match=r"token id 99 at index 1"):
        tok.decode([3, 99])
    with pytest.raises(TokenizerError, match="no repeated character"):
        CharTokenizer("0012")


def test_hf_tokenizer_save_load_and_chat(hf_dir):
    tok = Tokenizer.from_pretrained(hf_dir)
    assert isinstance(tok, TokenizerLike)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
    text = "hello world, what is 2+2?"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, add_bos=True)[0] == 1
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi  "}]
    rendered = tok.render_chat(msgs)
    assert (
        rendered
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert ids[0] == 1 and ids[-2:] == [2, tok.encode("\n")[0]]


def test_chat_template_matches_transformers(hf_dir):
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir)
    ours = Tokenizer.from_pretrained(hf_dir)
    for msgs in (
        [{"role": "user", "content": "what is 2+2?"}],
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b "},
        ],
    ):
        for gen in (True, False):
            assert ours.render_chat(msgs, add_generation_prompt=gen) == ref.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen
            )
    assert ours.encode("hello world") == ref("hello world", add_special_tokens=False).input_ids


def test_tokenizer_config_variants(hf_dir):
    cfg_path = hf_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["bos_token"] = {"content": "<|im_start|>", "lstrip": False}
    template = cfg.pop("chat_template")
    cfg_path.write_text(json.dumps(cfg))
    (hf_dir / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_pretrained(hf_dir)
    assert tok.bos_id == 1 and tok.chat_template is not None
    cfg["eos_token"] = "<nope>"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=r"eos_token='<nope>' is not in the vocabulary"):
        Tokenizer.from_pretrained(hf_dir)
    cfg_path.write_text("{\n\n oops")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json:3: invalid JSON"):
        Tokenizer.from_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        Tokenizer.from_pretrained(hf_dir)


def test_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="line 2"):
        ChatTemplate("ok\n{% for m in messages %}")
    t = ChatTemplate(CHATML)
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        t.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] must be a mapping"):
        t.render([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tiny_bpe()).render_chat([{"role": "user", "content": "x"}])
    # The sandbox refuses attribute access to Python internals.
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])
