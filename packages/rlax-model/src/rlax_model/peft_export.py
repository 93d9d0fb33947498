"""LoRA adapters as a PEFT adapter folder, with the HF base they were trained on beside them.

    DIR/adapter_config.json          peft's LoraConfig: r, lora_alpha, target_modules, ...
    DIR/adapter_model.safetensors    base_model.model.model.layers.{i}.<module>.lora_{A,B}.weight
    DIR/tokenizer.json, ...          the run's tokenizer (AutoTokenizer.from_pretrained(DIR))
    DIR/base/                        the frozen base as an HF folder (`save_hf_folder`)

`adapter_config.json` names DIR/base as `base_model_name_or_path`, so
`peft.AutoPeftModelForCausalLM.from_pretrained(DIR)` loads base and adapters in one call, and
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR / "base"), DIR)` too.

PEFT computes a target as W x + (lora_alpha / r) * B(A(x)) with `lora_A.weight` [r, in] and
`lora_B.weight` [out, r]; ours is x @ W + (alpha / r) * (x @ A) @ B with A [L, in, r] and
B [L, r, out] (`rlax_model.lora`): layer i's `lora_A.weight` is A[i].T, `lora_B.weight` B[i].T.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np
import safetensors.numpy

from rlax_core.config import LoraConfig
from rlax_core.tokenizer import CharTokenizer, Tokenizer
from rlax_model.checkpoint_hf import _LAYER_MAP
from rlax_model.config import ModelConfig
from rlax_model.hf_export import _write_folder, replace_folder
from rlax_model.transformer import Params

__all__ = ["save_peft_folder"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _module_path(target: str) -> str:
    """`q_proj` -> `self_attn.q_proj` (the HF module a target adapts)."""
    return _LAYER_MAP[target][0].removesuffix(".weight")


def peft_tensors(adapters: Any, num_layers: int) -> dict[str, np.ndarray]:
    """PEFT's tensor names and [r, in] / [out, r] float32 arrays for RLAX adapters."""
    tensors: dict[str, np.ndarray] = {}
    for target, adapter in adapters.items():
        a, b = np.asarray(adapter["a"], np.float32), np.asarray(adapter["b"], np.float32)
        for i in range(num_layers):
            prefix = f"base_model.model.model.layers.{i}.{_module_path(target)}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return tensors


def save_peft_folder(
    directory: str | os.PathLike[str],
    config: ModelConfig,
    base: Params,
    adapters: Any,
    lora: LoraConfig,
    tokenizer: Tokenizer | CharTokenizer,
) -> None:
    """Write `adapters` (trained with `lora` on `base`) as a PEFT adapter folder at
    `directory` with the base as an HF folder in `directory/base`; built in a temp folder
    and renamed into place, replacing an earlier PEFT export there."""
    directory = pathlib.Path(directory)
    targets = sorted(adapters)
    if set(targets) != set(lora.target_names()):
        raise ValueError(f"adapters for {targets}, but the LoRA config targets {list(lora.target_names())}")

    def write(tmp: pathlib.Path) -> None:
        _write_folder(tmp / "base", config, base, tokenizer, None, None)
        tokenizer.save(tmp, model_max_length=config.max_position_embeddings)
        safetensors.numpy.save_file(peft_tensors(adapters, config.num_layers), str(tmp / ADAPTER_WEIGHTS))
        adapter_config: dict[str, Any] = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str((directory / "base").resolve()),
            "r": lora.rank,
            "lora_alpha": lora.alpha,
            "lora_dropout": 0.0,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "inference_mode": True,
        }
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2))

    replace_folder(directory, write, marker=ADAPTER_CONFIG)
