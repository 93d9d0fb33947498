"""A complete HF model folder: weights + config.json, tokenizer files, chat template and
generation_config.json, so that `AutoTokenizer` and `AutoModelForCausalLM` load it as it is.

The folder is built under a temp name next to its destination and renamed into place, so
a conversion that stops half way never leaves a half-written folder behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from rlax_core.gguf_file import GGUFFile
from rlax_core.tokenizer import CharTokenizer, Tokenizer
from rlax_model.checkpoint_hf import CheckpointError, save_hf_checkpoint
from rlax_model.config import ModelConfig
from rlax_model.transformer import Params
from rlax_protocol.atomic_files import atomic_write_bytes

__all__ = ["gguf_sampling_defaults", "generation_config", "save_hf_folder"]

# llama.cpp's `general.sampling.*` keys that have a transformers GenerationConfig field.
_GGUF_SAMPLING = {
    "general.sampling.temp": ("temperature", float),
    "general.sampling.top_k": ("top_k", int),
    "general.sampling.top_p": ("top_p", float),
    "general.sampling.min_p": ("min_p", float),
    "general.sampling.penalty_repeat": ("repetition_penalty", float),
}


def gguf_sampling_defaults(file: GGUFFile) -> dict[str, Any]:
    """The sampling defaults a GGUF file recommends, as GenerationConfig fields
    (empty when it has none; then transformers' own defaults, greedy, apply)."""
    out = {field: cast(file.value(key)) for key, (field, cast) in _GGUF_SAMPLING.items() if file.has(key)}
    if out:
        out["do_sample"] = True  # the temperature/top-k/top-p given are meant to be used
    return out


def _ids(value: int | tuple[int, ...] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def generation_config(
    config: ModelConfig, tokenizer: Tokenizer | CharTokenizer, sampling: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """generation_config.json: BOS/EOS/pad ids (the model's, else the tokenizer's) plus
    `sampling` defaults. Every EOS id of the model and the tokenizer stops generation."""
    eos = _ids(config.eos_token_id)
    if tokenizer.eos_id is not None and tokenizer.eos_id not in eos:
        eos.append(int(tokenizer.eos_id))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_id
    gen: dict[str, Any] = {
        "bos_token_id": bos,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": int(tokenizer.pad_id),
    }
    gen.update(sampling or {})
    return gen


def _write_folder(
    directory: pathlib.Path,
    config: ModelConfig,
    params: Params,
    tokenizer: Tokenizer | CharTokenizer,
    sampling: Mapping[str, Any] | None,
    max_shard_bytes: int | None,
) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )
    # config.json carries BOS/EOS too; a run's model config may leave them to the tokenizer.
    config = dataclasses.replace(
        config,
        bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_id,
        eos_token_id=config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_id,
    )
    save_hf_checkpoint(directory, config, params, max_shard_bytes=max_shard_bytes)
    tokenizer.save(directory, model_max_length=config.max_position_embeddings)
    gen = generation_config(config, tokenizer, sampling)
    atomic_write_bytes(directory / "generation_config.json", json.dumps(gen, indent=2).encode())


def save_hf_folder(
    directory: str | os.PathLike[str],
    config: ModelConfig,
    params: Params,
    tokenizer: Tokenizer | CharTokenizer,
    *,
    sampling: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write a loadable HF folder at `directory`, replacing an earlier export there.

    Built in a sibling temp folder, then renamed into place. A non-empty `directory`
    without config.json is refused, since it is not an earlier export to replace.
    """
    replace_folder(
        pathlib.Path(directory),
        lambda tmp: _write_folder(tmp, config, params, tokenizer, sampling, max_shard_bytes),
        marker="config.json",
    )


def replace_folder(directory: pathlib.Path, write: Callable[[pathlib.Path], None], *, marker: str) -> None:
    """Build a folder with `write(tmp)` in a sibling temp folder and rename it to `directory`,
    replacing an earlier export there: one that holds `marker`. A non-empty `directory`
    without it is refused (it is not an earlier export)."""
    if directory.exists():
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: exists and is not a folder")
        if any(directory.iterdir()) and not (directory / marker).exists():
            raise CheckpointError(
                f"{directory}: not empty and not an earlier export ({marker}); refusing to replace it"
            )
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        # mkdtemp makes the folder private (0700); give it the usual mode for the umask.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        write(tmp)
        if directory.exists():
            old = tmp.with_name(f"{tmp.name}.old")
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
