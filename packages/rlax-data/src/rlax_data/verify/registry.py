"""Typed verifier configs and the registry that builds verifiers from them.

A config is a tagged msgspec Struct (`{"kind": "math", ...}`); `build_verifier` picks
the factory by the config's type. `load_verifier_config` validates a dict (from YAML)
with errors that name the bad field.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import msgspec

from rlax_data.verify.answers import ExactMatchConfig, ExactMatchVerifier, MathConfig, MathVerifier
from rlax_data.verify.base import Verifier, VerifyItem, VerifyResult
from rlax_data.verify.code import CodeConfig, CodeVerifier
from rlax_data.verify.countdown import CountdownConfig, CountdownVerifier
from rlax_data.verify.sandbox import SandboxConfig
from rlax_data.verify.shaping import ShapedVerifier, ShapingConfig

__all__ = [
    "RoutingConfig",
    "RoutingVerifier",
    "ShapedConfig",
    "build_verifier",
    "load_verifier_config",
    "register_verifier",
    "registered_configs",
    "sandbox_of",
]

_FACTORIES: dict[type, Callable[[Any], Verifier]] = {}

LeafConfig = Union[ExactMatchConfig, MathConfig, CountdownConfig, CodeConfig]  # noqa: UP007


class ShapedConfig(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind", tag="shaped"
):
    base: LeafConfig
    shaping: ShapingConfig = ShapingConfig()


class RoutingConfig(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind", tag="routing"
):
    """Routes each item to the verifier named by its `record.task` (or `default`)."""

    routes: dict[str, Union[LeafConfig, ShapedConfig]]  # noqa: UP007
    default: str | None = None

    def __post_init__(self) -> None:
        if not self.routes:
            raise ValueError("field `routes`: must name at least one verifier")
        if self.default is not None and self.default not in self.routes:
            raise ValueError(
                f"field `default`: {self.default!r} is not one of the routes {sorted(self.routes)}"
            )


class RoutingVerifier:
    """Dispatches each item by `record.task`; each sub-verifier gets its items as one batch."""

    def __init__(self, routes: Mapping[str, Verifier], default: str | None = None) -> None:
        if default is not None and default not in routes:
            raise ValueError(f"default: {default!r} is not one of the routes {sorted(routes)}")
        self.routes = dict(routes)
        self.default = default

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, (_, record) in enumerate(items):
            name = record.task or self.default
            if name is None or name not in self.routes:
                raise ValueError(
                    f"record {record.id!r}: field `task` is {record.task!r}, which names no verifier "
                    f"(routes: {sorted(self.routes)}, default: {self.default!r})"
                )
            groups[name].append(i)
        out: list[VerifyResult | None] = [None] * len(items)
        for name, idx in groups.items():
            for i, res in zip(idx, self.routes[name].verify([items[i] for i in idx]), strict=True):
                out[i] = res
        return out  # type: ignore[return-value]


def sandbox_of(verifier: Verifier) -> SandboxConfig | None:
    """The sandbox limits of a verifier that runs programs (code, shaped or not); None for
    one that runs none. A service runs the first kind off its receiving thread, and their
    `timeout_s` is the most any job of theirs may ask for."""
    if isinstance(verifier, ShapedVerifier):
        return sandbox_of(verifier.base)
    if isinstance(verifier, CodeVerifier):
        return verifier.config.sandbox
    return None


def register_verifier(config_type: type, factory: Callable[[Any], Verifier]) -> None:
    """Register `factory(config) -> Verifier` for a tagged msgspec Struct config type."""
    if not (isinstance(config_type, type) and issubclass(config_type, msgspec.Struct)):
        raise TypeError(f"config_type: must be a msgspec.Struct subclass, got {config_type!r}")
    if config_type.__struct_config__.tag is None:
        raise TypeError(f"config_type: {config_type.__name__} needs a `tag=` so configs can name it")
    _FACTORIES[config_type] = factory


def registered_configs() -> tuple[type, ...]:
    return tuple(_FACTORIES)


def build_verifier(config: Any, *, length_fn: Callable[[str], int] = len) -> Verifier:
    """Build the verifier a config describes (length_fn is used by shaped verifiers)."""
    if isinstance(config, ShapedConfig):
        return ShapedVerifier(build_verifier(config.base), config.shaping, length_fn)
    if isinstance(config, RoutingConfig):
        return RoutingVerifier(
            {k: build_verifier(v, length_fn=length_fn) for k, v in config.routes.items()}, config.default
        )
    factory = _FACTORIES.get(type(config))
    if factory is None:
        raise TypeError(f"no verifier registered for config type {type(config).__name__}")
    return factory(config)


def load_verifier_config(data: Mapping[str, Any]) -> Any:
    """Validate a dict such as `{"kind": "math", "timeout_s": 5}` into its config Struct.

    Raises ValueError naming the field at fault.
    """
    union = Union[tuple(_FACTORIES) + (ShapedConfig, RoutingConfig)]  # type: ignore[valid-type]  # noqa: UP007
    try:
        return msgspec.convert(dict(data), union)
    except msgspec.ValidationError as e:
        raise ValueError(f"verifier config: {e}") from None


register_verifier(ExactMatchConfig, ExactMatchVerifier)
register_verifier(MathConfig, MathVerifier)
register_verifier(CountdownConfig, CountdownVerifier)
register_verifier(CodeConfig, CodeVerifier)
