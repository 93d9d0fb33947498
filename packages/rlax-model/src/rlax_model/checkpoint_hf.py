"""Hugging Face checkpoints: `config.json` + `*.safetensors` (single file or sharded index).

Supported architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM. HF stores linear weights [out, in]; `Params` stores them [in, out] and
stacks layers, so loading transposes and stacks, saving splits and transposes back.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.flax
from safetensors import safe_open

from rlax_model.config import (
    ConfigError,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelConfig,
    RopeScaling,
)
from rlax_model.transformer import Params, param_shapes
from rlax_protocol.atomic_files import atomic_write_bytes

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_MODEL_TYPE_BY_ARCH = {v: k for k, v in _HF_ARCHITECTURES.items()}
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

# Our per-layer name -> (HF name under model.layers.{i}., transpose?)
_LAYER_MAP: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}
_TOP_MAP: dict[str, tuple[str, bool]] = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
# Buffers some old exports carry; they are recomputed, never loaded.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint is unusable; the message names the file, tensor or field."""


# ----------------------------------------------------------------------------- config


def _field(hf: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in hf or hf[name] is None:
        raise CheckpointError(f"{where}: required field {name!r} is missing")
    return hf[name]


def _rope_from_hf(hf: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older versions write
    # top-level `rope_theta` and `rope_scaling`.
    params = hf.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling")
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    try:
        if kind == "default":
            return float(theta), None
        if kind == "linear":
            return float(theta), LinearRopeScaling(factor=float(scaling["factor"]))
        if kind == "llama3":
            return float(theta), Llama3RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
    except KeyError as e:
        raise CheckpointError(f"{where}: rope scaling {kind!r} lacks field {e.args[0]!r}") from None
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None
    raise CheckpointError(
        f"{where}: rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


def config_from_hf(
    hf: Mapping[str, Any],
    *,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
    where: str = "config.json",
) -> ModelConfig:
    """Build a `ModelConfig` from an HF `config.json` dict; errors name the field and value."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if archs:
        if len(archs) != 1 or archs[0] not in _MODEL_TYPE_BY_ARCH:
            raise CheckpointError(
                f"{where}: architectures={archs!r} is not supported "
                f"(supported: {sorted(_MODEL_TYPE_BY_ARCH)})"
            )
        arch = _MODEL_TYPE_BY_ARCH[archs[0]]
    elif model_type in _HF_ARCHITECTURES:
        arch = model_type
    else:
        raise CheckpointError(
            f"{where}: model_type={model_type!r} is not supported (supported: {sorted(_HF_ARCHITECTURES)})"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias", False):
        raise CheckpointError(f"{where}: mlp_bias={hf['mlp_bias']!r} is not supported")
    if arch == "qwen2":
        attention_bias = True
    else:
        attention_bias = bool(hf.get("attention_bias", False))
        if attention_bias:
            # Llama/Mistral/Qwen3 put a bias on o_proj as well, which this model lacks.
            raise CheckpointError(f"{where}: attention_bias=True is not supported for {arch}")
    sliding_window = hf.get("sliding_window")
    if arch in ("qwen2", "qwen3"):
        if hf.get("use_sliding_window", False):
            raise CheckpointError(f"{where}: use_sliding_window=True is not supported for {arch}")
        sliding_window = None
    elif arch == "llama":
        sliding_window = None
    theta, scaling = _rope_from_hf(hf, where)
    heads = _field(hf, "num_attention_heads", where)
    hidden = _field(hf, "hidden_size", where)
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
            raise CheckpointError(
                f"{where}: head_dim is missing and hidden_size={hidden!r} is not divisible "
                f"by num_attention_heads={heads!r}"
            )
        head_dim = hidden // heads
    try:
        return ModelConfig(
            vocab_size=_field(hf, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_field(hf, "intermediate_size", where),
            num_layers=_field(hf, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "qwen3",
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            sliding_window=sliding_window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            param_dtype=param_dtype,  # type: ignore[arg-type]
            compute_dtype=compute_dtype or param_dtype,  # type: ignore[arg-type]
            architecture=arch,  # type: ignore[arg-type]
        )
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict for `config` (readable by transformers 4.x and 5.x)."""
    arch = config.architecture
    if config.qk_norm != (arch == "qwen3"):
        raise CheckpointError(
            f"ModelConfig.qk_norm={config.qk_norm!r} cannot be saved as architecture={arch!r} "
            "(q/k norm exists only in qwen3)"
        )
    if config.attention_bias != (arch == "qwen2"):
        raise CheckpointError(
            f"ModelConfig.attention_bias={config.attention_bias!r} cannot be saved as "
            f"architecture={arch!r} (q/k/v-only bias exists only in qwen2)"
        )
    if config.sliding_window is not None and arch != "mistral":
        raise CheckpointError(
            f"ModelConfig.sliding_window={config.sliding_window!r} cannot be saved as architecture={arch!r}"
        )
    hf: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_id)
        if isinstance(config.eos_token_id, tuple)
        else config.eos_token_id,
        "torch_dtype": config.param_dtype,
    }
    scaling = config.rope_scaling
    if isinstance(scaling, LinearRopeScaling):
        hf["rope_scaling"] = {"rope_type": "linear", "factor": scaling.factor}
    elif isinstance(scaling, Llama3RopeScaling):
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    if arch in ("llama", "qwen3"):
        hf["attention_bias"] = False
    if arch == "llama":
        hf["mlp_bias"] = False
    if arch in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
    if arch == "mistral":
        hf["sliding_window"] = config.sliding_window
    return hf


# ----------------------------------------------------------------------------- tensors


def _hf_names(config: ModelConfig) -> Iterator[tuple[str, int | None, str, bool]]:
    """(our name, layer index or None, HF name, transpose?) for every expected tensor."""
    shapes = param_shapes(config)
    for ours in shapes:
        if ours == "layers":
            continue
        hf_name, transpose = _TOP_MAP[ours]
        yield ours, None, hf_name, transpose
    for i in range(config.num_layers):
        for ours in shapes["layers"]:
            suffix, transpose = _LAYER_MAP[ours]
            yield ours, i, f"model.layers.{i}.{suffix}", transpose


def _weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file that holds it."""
    index = directory / SAFE_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        out = {}
        for name, file in weight_map.items():
            path = directory / file
            if not path.exists():
                raise CheckpointError(f"{index}: tensor {name!r} points at missing file {file!r}")
            out[name] = path
        return out
    single = directory / SAFE_SINGLE
    if not single.exists():
        raise CheckpointError(f"{directory}: neither {SAFE_SINGLE} nor {SAFE_INDEX} exists")
    with safe_open(str(single), framework="numpy") as f:
        return {name: single for name in f.keys()}


def load_hf_config(directory: str | os.PathLike[str], **kwargs: Any) -> ModelConfig:
    """Read `directory/config.json` into a `ModelConfig` (kwargs as in `config_from_hf`)."""
    path = pathlib.Path(directory) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: config.json is missing")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    return config_from_hf(hf, where=str(path), **kwargs)


def load_hf_checkpoint(
    directory: str | os.PathLike[str],
    *,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
) -> tuple[ModelConfig, Params]:
    """Load an HF checkpoint directory. Returns (config, params in `param_dtype`).

    Raises `CheckpointError` naming the tensor for a missing, unexpected or mis-shaped one.
    """
    directory = pathlib.Path(directory)
    config = load_hf_config(directory, param_dtype=param_dtype, compute_dtype=compute_dtype)
    files = _weight_files(directory)
    expected = list(_hf_names(config))
    expected_names = {hf_name for _, _, hf_name, _ in expected}
    tied_head = config.tie_word_embeddings and "lm_head.weight" in files
    for name in files:
        if (
            name not in expected_names
            and not _IGNORED.match(name)
            and not (tied_head and name == "lm_head.weight")
        ):
            raise CheckpointError(f"{directory}: unexpected tensor {name!r} for {config.architecture}")
    shapes = param_shapes(config)
    np_dtype = np.dtype(jnp.dtype(config.param_jnp_dtype))
    top: dict[str, Any] = {}
    per_layer: dict[str, list[np.ndarray]] = {k: [] for k in shapes["layers"]}
    with contextlib.ExitStack() as stack:
        handles: dict[pathlib.Path, Any] = {}

        def read(hf_name: str) -> tuple[pathlib.Path, np.ndarray]:
            path = files[hf_name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="numpy"))
            return path, handles[path].get_tensor(hf_name)

        for ours, layer, hf_name, transpose in expected:
            if hf_name not in files:
                raise CheckpointError(f"{directory}: tensor {hf_name!r} is missing")
            path, arr = read(hf_name)
            want = shapes[ours] if layer is None else shapes["layers"][ours][1:]
            got = arr.shape[::-1] if transpose else arr.shape
            if tuple(got) != tuple(want):
                hf_want = tuple(want[::-1]) if transpose else tuple(want)
                raise CheckpointError(
                    f"{path.name}: tensor {hf_name!r} has shape {tuple(arr.shape)}, expected {hf_want}"
                )
            arr = np.ascontiguousarray((arr.T if transpose else arr).astype(np_dtype))
            if layer is None:
                top[ours] = arr
            else:
                per_layer[ours].append(arr)
        if tied_head:
            _, head = read("lm_head.weight")
            if head.shape != top["embed"].shape or not np.array_equal(head.astype(np_dtype), top["embed"]):
                raise CheckpointError(
                    f"{directory}: tie_word_embeddings=True but tensor 'lm_head.weight' differs from "
                    "'model.embed_tokens.weight'"
                )
    params: Params = {k: jnp.asarray(v) for k, v in top.items()}
    params["layers"] = {k: jnp.asarray(np.stack(v)) for k, v in per_layer.items()}
    return config, params


def _check_params(params: Params, config: ModelConfig) -> None:
    want = param_shapes(config)
    got = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
    if got != want:
        flat_w = dict(jax.tree_util.tree_flatten_with_path(want, is_leaf=lambda x: isinstance(x, tuple))[0])
        flat_g = dict(jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: isinstance(x, tuple))[0])
        for path in sorted(set(flat_w) | set(flat_g), key=str):
            name = jax.tree_util.keystr(path)
            if path not in flat_g:
                raise CheckpointError(f"params{name} is missing (expected shape {flat_w[path]})")
            if path not in flat_w:
                raise CheckpointError(f"params{name} is not a parameter of this config")
            if flat_w[path] != flat_g[path]:
                raise CheckpointError(f"params{name} has shape {flat_g[path]}, expected {flat_w[path]}")


def save_hf_checkpoint(
    directory: str | os.PathLike[str],
    config: ModelConfig,
    params: Params,
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write `config.json` and safetensors (sharded with an index when the tensors exceed
    `max_shard_bytes`). Tensors keep their dtype; every file is written to a temp name,
    fsynced and renamed, config.json last."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = config_to_hf(config)
    _check_params(params, config)
    tensors: dict[str, jax.Array] = {}
    for ours, layer, hf_name, transpose in _hf_names(config):
        arr = params[ours] if layer is None else params["layers"][ours][layer]
        tensors[hf_name] = jnp.asarray(arr.T if transpose else arr)
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for name, arr in tensors.items():
        nbytes = arr.size * arr.dtype.itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += nbytes
    metadata = {"format": "pt"}
    written: set[str] = set()
    if len(shards) == 1:
        atomic_write_bytes(directory / SAFE_SINGLE, safetensors.flax.save(shards[0], metadata=metadata))
        written.add(SAFE_SINGLE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            atomic_write_bytes(directory / fname, safetensors.flax.save(shard, metadata=metadata))
            weight_map.update(dict.fromkeys(shard, fname))
            written.add(fname)
        total = sum(a.size * a.dtype.itemsize for a in tensors.values())
        index = {"metadata": {"total_size": int(total)}, "weight_map": weight_map}
        atomic_write_bytes(directory / SAFE_INDEX, json.dumps(index, indent=2).encode())
        written.add(SAFE_INDEX)
    # Weights of an earlier save in this folder would be mixed with the new ones on load.
    for stale in [SAFE_SINGLE, SAFE_INDEX, *(p.name for p in directory.glob("model-*-of-*.safetensors"))]:
        if stale not in written and (directory / stale).exists():
            (directory / stale).unlink()
    atomic_write_bytes(directory / "config.json", json.dumps(hf_config, indent=2).encode())
