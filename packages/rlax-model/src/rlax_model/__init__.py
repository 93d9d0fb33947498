"""rlax_model: the Llama-family decoder shared by the RLAX trainer and inference engine."""

from rlax_core.gguf_file import GGUFError, GGUFFile, find_smollm2_gguf
from rlax_model.attention import (
    AttentionFn,
    DenseContext,
    PackedContext,
    causal_valid_mask,
    dense_attention_reference,
    dense_causal_attention,
    positions_from_valid,
)
from rlax_model.checkpoint_hf import (
    CheckpointError,
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    load_hf_config,
    save_hf_checkpoint,
)
from rlax_model.config import (
    ConfigError,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelConfig,
    RopeScaling,
)
from rlax_model.dtype_policy import BF16_ON_CPU_ENV, dtype_policy, resolve_dtypes
from rlax_model.gguf_import import gguf_config, load_gguf
from rlax_model.logprobs import logprobs, token_logprobs_from_logits
from rlax_model.transformer import (
    Params,
    Remat,
    forward,
    hidden_states,
    init_params,
    lm_head_weight,
    param_shapes,
    project_logits,
)

__all__ = [
    "BF16_ON_CPU_ENV",
    "AttentionFn",
    "CheckpointError",
    "ConfigError",
    "DenseContext",
    "PackedContext",
    "GGUFError",
    "GGUFFile",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "ModelConfig",
    "Params",
    "Remat",
    "RopeScaling",
    "causal_valid_mask",
    "config_from_hf",
    "config_to_hf",
    "dense_attention_reference",
    "dense_causal_attention",
    "dtype_policy",
    "find_smollm2_gguf",
    "forward",
    "gguf_config",
    "hidden_states",
    "init_params",
    "lm_head_weight",
    "load_gguf",
    "load_hf_checkpoint",
    "load_hf_config",
    "logprobs",
    "param_shapes",
    "positions_from_valid",
    "project_logits",
    "resolve_dtypes",
    "save_hf_checkpoint",
    "token_logprobs_from_logits",
]
