"""Import llama-architecture GGUF files (llama.cpp's format) into `Params`.

Tensors are dequantised to float32 with the `gguf` package. llama.cpp's converter reorders
the rows of the Q and K projections of each head (it interleaves the two rotary halves, to
suit its own RoPE kernel); `unpermute_rope_rows` undoes that so the weights match the
half-split RoPE of `rlax_model.layers.apply_rope` (and of HF checkpoints).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from rlax_core.gguf_file import GGUFError, GGUFFile
from rlax_model.config import ConfigError, ModelConfig
from rlax_model.transformer import Params, param_shapes

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
