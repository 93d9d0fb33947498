"""The run's model (`rlax_model.ModelConfig` and initial parameters) from the run config.

The trainer and every worker call `build_model_config` with the same config and
tokenizer, so they agree on every shape without exchanging anything but weights.
"""

from __future__ import annotations

from typing import Any

from rlax_core.config import RunConfig

__all__ = [
    "build_model_config",
    "checked_model_config",
    "initial_params",
    "require_platform",
    "use_compile_cache",
]

# The fields of `model:` that describe the `tiny` model's shape, named as in ModelConfig.
TINY_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
# `JAX_PLATFORMS` names that JAX's backend reports under another name.
_BACKEND_OF = {"cuda": "gpu", "rocm": "gpu"}


def build_model_config(config: RunConfig, tokenizer: Any) -> Any:
    """`rlax_model.ModelConfig` of the run (shapes only; loading a file reads its header)."""
    from rlax_model import ModelConfig

    m = config.model
    if m.source == "tiny":
        # The section's shape fields carry ModelConfig's names: passed by name, not translated.
        shape = {name: getattr(m, name) for name in TINY_SHAPE_FIELDS}
        return ModelConfig.tiny(
            vocab_size=int(tokenizer.vocab_size),
            **shape,
            head_dim=m.hidden_size // m.num_heads,
            max_position_embeddings=m.max_seq_len,
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
            param_dtype=m.param_dtype,
        )
    if m.source == "gguf":
        from rlax_core.gguf_file import GGUFFile, find_smollm2_gguf
        from rlax_model.gguf_import import gguf_config

        return gguf_config(GGUFFile(m.path or find_smollm2_gguf()), param_dtype=m.param_dtype)
    from rlax_model import load_hf_config

    return load_hf_config(m.path, param_dtype=m.param_dtype)


def initial_params(config: RunConfig, tokenizer: Any) -> tuple[Any, Any]:
    """(ModelConfig, params): random init for `tiny` (seeded by run.seed), else the file's weights."""
    import jax

    from rlax_core.gguf_file import find_smollm2_gguf
    from rlax_model import init_params, load_hf_checkpoint
    from rlax_model.gguf_import import load_gguf

    m = config.model
    if m.source == "tiny":
        model_config = build_model_config(config, tokenizer)
        return model_config, init_params(model_config, jax.random.key(config.run.seed))
    if m.source == "gguf":
        return load_gguf(m.path or find_smollm2_gguf(), param_dtype=m.param_dtype)
    return load_hf_checkpoint(m.path, param_dtype=m.param_dtype)


def checked_model_config(config: RunConfig, tokenizer: Any) -> Any:
    """`build_model_config`, with a bad `model.*` (a missing file included: it will not
    appear on a restart) reported as a `ConfigError` that names the model."""
    from rlax_core.config import rejected_by

    def model() -> Any:
        try:
            return build_model_config(config, tokenizer)
        except FileNotFoundError as error:
            raise ValueError(f"model.path: {error}") from None

    return rejected_by("the model (model.*)", model)


def require_platform(platform: str, field: str) -> str:
    """JAX's backend, which must be the first of `platform` (a `JAX_PLATFORMS` value set by
    `rlax_core.cli.select_platform`; empty: any). A platform that is absent here is a
    `ConfigError` naming `field`, never a run on another device: JAX either fails to start
    it or, when a backend had started before the choice was made, runs on that one."""
    import jax

    from rlax_core.config import ConfigError

    try:
        backend = str(jax.default_backend())
    except Exception as error:  # RuntimeError, or an AssertionError for a missing plugin
        raise ConfigError(
            f"{field} = {platform!r}: JAX cannot start that platform on this machine "
            f"({type(error).__name__}: {str(error)[:300]})"
        ) from None
    wanted = platform.split(",")[0].strip().lower()
    if wanted and _BACKEND_OF.get(wanted, wanted) != backend:
        raise ConfigError(f"{field} = {platform!r}, but JAX runs on {backend!r} in this process")
    return backend


def use_compile_cache(config: RunConfig) -> None:
    """JAX's persistent compilation cache at `run.jax_cache_dir` (default `<run>/jax_cache`),
    so a restarted trainer or worker reuses the executables its previous life compiled."""
    import jax

    folder = config.run.jax_cache_dir or str(config.output_dir / "jax_cache")
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
