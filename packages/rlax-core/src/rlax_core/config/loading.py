"""Reading a run config: YAML files that build on each other, dotted overrides, and where
every value came from.

A file may name the files it builds on with `base:` (a path, or a list of paths, relative
to the file); their sections are merged key by key, in order, and the file's own keys win,
except `data.task_args`, which a file sets whole: the arguments of one task mean nothing to
another (a sorting config on the arithmetic demo must not inherit its `digits`).
Overrides (`trainer.optimizer.lr=1e-6`) apply last. `load_config_with_sources` also says,
for every value a file or an override set, which one set it (`rlax config show` prints it).
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import msgspec
import yaml

from rlax_core.config.base import ConfigError
from rlax_core.config.run_config import RunConfig
from rlax_protocol.atomic_files import atomic_write_bytes

BASE_KEY = "base"
DEFAULT_SOURCE = "default"
OVERRIDE_SOURCE = "override"
# Fields renamed when the run config and the components' configs became one: the old name
# is still recognised in an error message, so an old config says where its value now goes.
RENAMED_FIELDS = {
    "trainer.lr": "trainer.optimizer.lr",
    "trainer.lr_schedule": "trainer.optimizer.schedule",
    "trainer.min_lr_ratio": "trainer.optimizer.min_lr_ratio",
    "trainer.warmup_steps": "trainer.optimizer.warmup_steps",
    "trainer.weight_decay": "trainer.optimizer.weight_decay",
    "trainer.max_grad_norm": "trainer.optimizer.max_grad_norm",
    "model.d_model": "model.hidden_size",
    "model.n_layers": "model.num_layers",
    "model.n_heads": "model.num_heads",
    "model.n_kv_heads": "model.num_kv_heads",
    "model.d_ff": "model.intermediate_size",
    "workers.max_batch_seqs": "workers.max_num_seqs",
    "workers.decode_steps": "workers.num_decode_steps",
}
_MAX_BASE_DEPTH = 16
_SET_WHOLE = ("data.task_args",)  # mappings a file replaces instead of merging into


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _lookup(raw: Any, path: str) -> tuple[bool, Any]:
    node = raw
    for key, index in re.findall(r"\.([A-Za-z0-9_]+)|\[(\d+)\]", path):
        try:
            node = node[key] if key else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _explain(error: msgspec.ValidationError, raw: dict[str, Any], source: str) -> ConfigError:
    message = str(error)
    match = _AT.search(message)
    path = match.group("path").lstrip(".") if match else ""
    detail = _AT.sub("", message)
    unknown = re.match(r"Object contains unknown field `(?P<key>[^`]+)`", detail)
    if unknown:
        field = f"{path}.{unknown.group('key')}" if path else unknown.group("key")
        moved = RENAMED_FIELDS.get(field)
        hint = f" (it is `{moved}` now)" if moved else ""
        return ConfigError(f"{source}: unknown config field `{field}`{hint}")
    if re.match(r"^[A-Za-z_][\w.]*(\[\d+\])? = ", detail):
        # Raised by a section's own check: it already names its field and value.
        return ConfigError(f"{source}: {path}.{detail}" if path else f"{source}: {detail}")
    found, value = _lookup(raw, "." + path if path and not path.startswith("[") else path)
    shown = f" (got {value!r})" if found else ""
    return ConfigError(f"{source}: config field `{path or '<root>'}`: {detail}{shown}")


def parse_config(raw: dict[str, Any], source: str = "<config>") -> RunConfig:
    """Validate a plain dict (from YAML) into a `RunConfig`; raises `ConfigError`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return msgspec.convert(raw, RunConfig, strict=False)
    except msgspec.ValidationError as error:
        raise _explain(error, raw, source) from None


def _parse_scalar(text: str) -> Any:
    # YAML's scalar rules ("1e-6" is a float only with a dot in YAML 1.1), then numbers.
    value = yaml.safe_load(text) if text.strip() else ""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.field=value` overrides (values parsed as YAML) to a raw config dict."""
    result: dict[str, Any] = _deep_copy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. trainer.lr=1e-6")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty name in dotted key {key!r}")
        node = result
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: `{part}` is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(text)
    return result


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections, got {type(loaded).__name__}")
    return loaded


def leaf_paths(raw: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the values in `raw` (a mapping's entries recursively; a list is one value)."""
    if isinstance(raw, dict) and raw:
        return [leaf for key, value in raw.items() for leaf in leaf_paths(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if prefix else []


def _merge(into: dict[str, Any], update: dict[str, Any], prefix: str = "") -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and prefix + key not in _SET_WHOLE:
            _merge(into[key], value, f"{prefix}{key}.")
        else:
            into[key] = _deep_copy(value)


def read_config_file(
    path: str | pathlib.Path, _chain: tuple[pathlib.Path, ...] = ()
) -> tuple[dict[str, Any], dict[str, str]]:
    """(the file's sections merged over those of its `base:` files, the file that set each
    value by dotted path). A missing base, a cycle of bases, or a `base` that is not a path
    or a list of paths is a `ConfigError` naming the file."""
    path = pathlib.Path(path)
    here = path.resolve()
    if here in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, here))
        raise ConfigError(f"{path}: `base:` files include each other: {cycle}")
    if len(_chain) >= _MAX_BASE_DEPTH:
        raise ConfigError(f"{path}: more than {_MAX_BASE_DEPTH} nested `base:` files")
    own = _read_yaml(path)
    bases = own.pop(BASE_KEY, [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"{path}: `base:` must be a file path or a list of file paths, got {bases!r}")
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for base in bases:
        base_raw, base_sources = read_config_file(path.parent / base, (*_chain, here))
        _merge(raw, base_raw)
        sources.update(base_sources)
    _merge(raw, own)
    for whole in _SET_WHOLE:  # what the bases set under a mapping this file sets whole is gone
        section, name = whole.split(".")
        if name in own.get(section, {}):
            sources = {k: v for k, v in sources.items() if not k.startswith(whole + ".")}
    label = os.path.normpath(path)
    sources.update({leaf: label for leaf in leaf_paths(own)})
    return raw, sources


def load_config_with_sources(
    path: str | pathlib.Path | None, overrides: list[str] | None = None
) -> tuple[RunConfig, dict[str, str]]:
    """`load_config`, and where each value set by a file or an override came from: dotted
    path -> the file's path or `override` (a value absent from both is its section's default)."""
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        raw, sources = read_config_file(path)
    overrides = list(overrides or [])
    raw = apply_overrides(raw, overrides)
    for item in overrides:
        sources[item.split("=", 1)[0].strip()] = OVERRIDE_SOURCE
    return parse_config(raw, source), sources


def load_config(path: str | pathlib.Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config (or the defaults when `path` is None), its `base:` files
    merged under it, with dotted overrides applied last."""
    return load_config_with_sources(path, overrides)[0]


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(config)
    return data


def dump_config(config: RunConfig, path: str | pathlib.Path) -> pathlib.Path:
    """Write the fully resolved config as YAML (atomically) so every process reads the same one."""
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
    return atomic_write_bytes(pathlib.Path(path), text.encode())
