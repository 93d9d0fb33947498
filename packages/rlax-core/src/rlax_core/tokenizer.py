"""Tokenizers: a wrapper over HF `tokenizers` (from tokenizer.json or GGUF metadata) and a
small built-in character-level tokenizer for synthetic tasks."""

from __future__ import annotations

import json
import os
import pathlib
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from rlax_core.chat_template import ChatTemplate, ChatTemplateError
from rlax_core.gguf_file import GGUFFile
from rlax_protocol.atomic_files import atomic_write_bytes


class TokenizerError(ValueError):
    """A tokenizer cannot be built or used; the message names the file, field or text."""


@runtime_checkable
class TokenizerLike(Protocol):
    """What the data pipeline, engine and trainer need from any tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int | None: ...
    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False, special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]: ...


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(content := value.get("content"), str):
        return content
    raise TokenizerError(f"special token {value!r} is neither a string nor a {{'content': ...}} mapping")


def write_hf_tokenizer_files(
    directory: str | os.PathLike[str],
    backend: tokenizers.Tokenizer,
    *,
    bos_token: str | None,
    eos_token: str | None,
    pad_token: str | None,
    chat_template: str | None,
    model_max_length: int | None = None,
) -> None:
    """The three files of an HF tokenizer folder, each written atomically.

    `tokenizer_class` is the generic `PreTrainedTokenizerFast` so that transformers uses
    tokenizer.json as it is (a model-specific class may rebuild the pre-tokenizer), and
    no BOS is added on encode: the chat template places it, as in RLAX.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / "tokenizer.json", backend.to_str().encode())
    specials = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    if model_max_length is not None:
        cfg["model_max_length"] = int(model_max_length)
    atomic_write_bytes(directory / "tokenizer_config.json", json.dumps(cfg, indent=2).encode())
    present = {k: v for k, v in specials.items() if v is not None}
    atomic_write_bytes(directory / "special_tokens_map.json", json.dumps(present, indent=2).encode())


class _ChatRendering:
    """Chat rendering shared by both tokenizers: a `chat_template` plus `encode`."""

    chat_template: ChatTemplate | None

    if TYPE_CHECKING:

        def encode(self, text: str, *, add_bos: bool = False, special_tokens: bool = True) -> list[int]: ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The chat template applied to `messages`, as text."""
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered chat (the template itself places any BOS token)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra))


class Tokenizer(_ChatRendering):
    """HF `tokenizers` tokenizer plus special tokens and a chat template.

    Build with `Tokenizer.from_pretrained(directory)` (tokenizer.json + tokenizer_config.json
    [+ chat_template.jinja]) or `Tokenizer.from_gguf(path)`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self._plain: tokenizers.Tokenizer | None = None  # the backend reading specials as text
        self._plain_lock = threading.Lock()
        self._max_token_chars: int | None = None
        self._ids: dict[str, int | None] = {}
        for field, token in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)):
            tid = None if token is None else backend.token_to_id(token)
            if token is not None and tid is None:
                raise TokenizerError(f"{field}={token!r} is not in the vocabulary")
            self._ids[field] = tid
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = (
            None
            if chat_template is None
            else ChatTemplate(chat_template, bos_token=bos_token, eos_token=eos_token)
        )

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        directory = pathlib.Path(directory)
        tok_file = directory / "tokenizer.json"
        if not tok_file.exists():
            raise TokenizerError(f"{tok_file}: tokenizer.json is missing")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tok_file}: cannot be parsed ({e})") from None
        cfg: dict[str, Any] = {}
        cfg_file = directory / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_file}:{e.lineno}: invalid JSON ({e.msg})") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        return cls(
            backend,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            pad_token=_token_text(cfg.get("pad_token")),
            chat_template=template,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFFile) -> Tokenizer:
        """Byte-level BPE ("gpt2" model) tokenizer from GGUF `tokenizer.ggml.*` metadata
        (`path` may be an already opened `GGUFFile`)."""
        file = path if isinstance(path, GGUFFile) else GGUFFile(path)
        kind = file.value("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"{file.path.name}: tokenizer.ggml.model={kind!r} is not supported (only 'gpt2')"
            )
        tokens: list[str] = file.value("tokenizer.ggml.tokens")
        types: list[int] = file.value("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in file.value("tokenizer.ggml.merges")]
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = file.value("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            # SmolLM's own tokenizer.json splits digits one by one before the byte-level regex.
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in ("default", "gpt2"):
            backend.pre_tokenizer = byte_level
        else:
            raise TokenizerError(f"{file.path.name}: tokenizer.ggml.pre={pre!r} is not supported")
        backend.decoder = decoders.ByteLevel()
        control = 3  # llama.cpp token type CONTROL
        backend.add_special_tokens(
            [
                tokenizers.AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == control
            ]
        )

        def special(key: str) -> str | None:
            tid = file.value(key, None)
            return None if tid is None else tokens[int(tid)]

        return cls(
            backend,
            bos_token=special("tokenizer.ggml.bos_token_id"),
            eos_token=special("tokenizer.ggml.eos_token_id"),
            pad_token=special("tokenizer.ggml.padding_token_id"),
            chat_template=file.value("tokenizer.chat_template", None),
        )

    def save(self, directory: str | os.PathLike[str], *, model_max_length: int | None = None) -> None:
        """Write tokenizer.json, tokenizer_config.json (with the chat template) and
        special_tokens_map.json: a folder `transformers.AutoTokenizer` loads as it is."""
        write_hf_tokenizer_files(
            directory,
            self.backend,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            chat_template=None if self.chat_template is None else self.chat_template.source,
            model_max_length=model_max_length,
        )

    # -- use ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        return self._ids["bos_token"]

    @property
    def eos_id(self) -> int | None:
        return self._ids["eos_token"]

    @property
    def pad_id(self) -> int:
        pad = self._ids["pad_token"]
        if pad is None:
            pad = self._ids["eos_token"]
        if pad is None:
            raise TokenizerError("tokenizer has neither pad_token nor eos_token to pad with")
        return pad

    def encode(self, text: str, *, add_bos: bool = False, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. special_tokens: special-token strings in it map to their ids;
        False: they are plain text, spelled by ordinary tokens, and so are the other added
        tokens (Qwen's `<tool_call>`, `</tool_response>`): text no one in the run wrote, such
        as a tool's output, cannot forge a turn boundary or an end of sequence."""
        backend = self.backend if special_tokens else self._plain_backend()
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but the tokenizer has no bos_token")
            ids = [self.bos_id, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens))

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (the added tokens marked special: turn markers, BOS/EOS)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @property
    def max_token_chars(self) -> int:
        """At most how many characters of text one token stands for (the longest vocabulary
        entry, which spells at least as many bytes as characters; doubled when a normalizer
        may shorten the text first): text longer than `n * max_token_chars` has more than
        `n` tokens, known without tokenizing it."""
        if self._max_token_chars is None:
            longest = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
            self._max_token_chars = longest * (2 if self.backend.normalizer is not None else 1)
        return self._max_token_chars

    def _plain_backend(self) -> tokenizers.Tokenizer:
        # A copy, not a toggle of the shared backend: encodes run in several threads. Every
        # added token is marked special in it, so that `encode_special_tokens` spells them all.
        with self._plain_lock:
            if self._plain is None:
                config = json.loads(self.backend.to_str())
                for token in config.get("added_tokens") or ():
                    token["special"] = True
                plain = tokenizers.Tokenizer.from_str(json.dumps(config))
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain


DEFAULT_ALPHABET = "0123456789+-*/%=()<>.,:;?! abcdefghijklmnopqrstuvwxyz"
# A plain format for synthetic tasks: "user text=answer" style prompts need no roles.
DEFAULT_CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
)


class CharTokenizer(_ChatRendering):
    """A character-level tokenizer for synthetic tasks (arithmetic and the like).

    Ids: 0 = "<pad>", 1 = "<bos>", 2 = "<eos>", then one id per character of `alphabet`
    in order. The special-token strings may appear in text. A character outside the
    alphabet raises `TokenizerError` naming it and its index.
    """

    PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

    def __init__(
        self, alphabet: str = DEFAULT_ALPHABET, *, chat_template: str | None = DEFAULT_CHAR_CHAT_TEMPLATE
    ) -> None:
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise TokenizerError(f"alphabet={alphabet!r}: must be non-empty with no repeated character")
        self.alphabet = alphabet
        self.specials = (self.PAD, self.BOS, self.EOS)
        self._id = {c: i + len(self.specials) for i, c in enumerate(alphabet)}
        self._char = [*self.specials, *alphabet]
        self.chat_template = (
            None
            if chat_template is None
            else ChatTemplate(chat_template, bos_token=self.BOS, eos_token=self.EOS)
        )

    def hf_backend(self) -> tokenizers.Tokenizer:
        """The same ids as an HF `tokenizers` tokenizer: one word-level token per
        character, the three specials matched as whole tokens first. A character outside
        the alphabet has no id and fails there too (no unk token)."""
        core = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(self._char)}))
        core.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
        core.decoder = decoders.Fuse()
        core.add_special_tokens(
            [tokenizers.AddedToken(s, special=True, normalized=False) for s in self.specials]
        )
        return core

    def save(self, directory: str | os.PathLike[str], *, model_max_length: int | None = None) -> None:
        """Write an HF tokenizer folder over the same ids (see `hf_backend`)."""
        write_hf_tokenizer_files(
            directory,
            self.hf_backend(),
            bos_token=self.BOS,
            eos_token=self.EOS,
            pad_token=self.PAD,
            chat_template=None if self.chat_template is None else self.chat_template.source,
            model_max_length=model_max_length,
        )

    @property
    def vocab_size(self) -> int:
        return len(self._char)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(self.specials)))

    @property
    def max_token_chars(self) -> int:
        """One character per token of plain text (`encode(..., special_tokens=False)`)."""
        return 1

    def encode(self, text: str, *, add_bos: bool = False, special_tokens: bool = True) -> list[int]:
        """special_tokens=False: "<eos>" and the like are spelled character by character
        (an error if the alphabet lacks one of their characters)."""
        ids = [self.bos_id] if add_bos else []
        i = 0
        while i < len(text):
            for sid, s in enumerate(self.specials if special_tokens else ()):
                if text.startswith(s, i):
                    ids.append(sid)
                    i += len(s)
                    break
            else:
                tid = self._id.get(text[i])
                if tid is None:
                    raise TokenizerError(
                        f"character {text[i]!r} at index {i} is not in the alphabet {self.alphabet!r}"
                    )
                ids.append(tid)
                i += 1
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        out = []
        for pos, t in enumerate(ids):
            t = int(t)
            if not 0 <= t < len(self._char):
                raise TokenizerError(f"token id {t} at index {pos} is outside [0, {len(self._char)})")
            if skip_special_tokens and t < len(self.specials):
                continue
            out.append(self._char[t])
        return "".join(out)
