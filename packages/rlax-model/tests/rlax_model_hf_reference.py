"""Tiny random HF `transformers` checkpoints, made offline, as an independent reference."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, extra config fields)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_theta=5000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=4, head_dim=16, rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
}


def make_hf_model(arch: str, seed: int = 0) -> Any:
    """A random fp32 HF model whose every weight (norms and biases too) is non-trivial."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**TINY, **extra)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def save_hf_model(arch: str, directory: pathlib.Path, seed: int = 0) -> Any:
    model = make_hf_model(arch, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model: Any, tokens: np.ndarray, valid: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """logits [batch, seq, vocab] float32 from transformers' own forward."""
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(tokens.astype(np.int64)),
            attention_mask=torch.from_numpy(valid.astype(np.int64)),
            position_ids=torch.from_numpy(positions.astype(np.int64)),
            use_cache=False,
        )
    return out.logits.float().numpy()
