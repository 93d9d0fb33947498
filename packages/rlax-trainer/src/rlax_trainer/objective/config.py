"""The typed objective config, its presets and YAML composition."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import yaml

from rlax_core.config.trainer import merge_objective, objective_presets
from rlax_trainer.objective.advantages import AdvantageEstimator, advantage_from_dict, advantage_to_dict
from rlax_trainer.objective.aggregation import Aggregation
from rlax_trainer.objective.importance import ImportanceConfig
from rlax_trainer.objective.regularizers import KLConfig
from rlax_trainer.objective.turn_credit import CreditConfig

__all__ = [
    "ObjectiveConfig",
    "OverlongConfig",
    "PRESET_NAMES",
    "ValueConfig",
    "load_objective",
    "objective_from_dict",
    "objective_to_dict",
    "overlong_penalty",
    "preset",
    "shape_rewards",
]


class ValueConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Value-head loss `coef * 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2)`; clip None disables clipping."""

    coef: float = 0.5
    clip: float | None = 0.2

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"coef must be > 0, got {self.coef}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")


class OverlongConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """DAPO's soft overlong punishment added to the reward of a response of length L:
    0 up to `max_length - cache_length`, then linearly down to `-penalty` at `max_length`,
    `-penalty` beyond."""

    max_length: int
    cache_length: int
    penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.max_length >= 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if not 1 <= self.cache_length <= self.max_length:
            raise ValueError(
                f"cache_length must be in [1, max_length={self.max_length}], got {self.cache_length}"
            )
        if not self.penalty >= 0:
            raise ValueError(f"penalty must be >= 0, got {self.penalty}")


class ObjectiveConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`loss = sum Agg * (-Adv * clipped_surrogate(IS) + kl.coef * KL - entropy_coef * H)`
    (+ value loss); the regularisers sit outside the clipped surrogate (see `loss.py`).

    `max_length` is L_max for `aggregation: max_length` (None: the batch's padded length).
    `credit`: how a multi-turn trajectory's per-turn rewards reach its tokens
    (`turn_credit.py`): `trajectory` (default) or `per_turn` returns discounted by `gamma`.
    """

    advantage: AdvantageEstimator
    aggregation: Aggregation = "sequence"
    importance: ImportanceConfig = ImportanceConfig()
    kl: KLConfig = KLConfig()
    entropy_coef: float = 0.0
    value: ValueConfig | None = None
    overlong: OverlongConfig | None = None
    max_length: int | None = None
    credit: CreditConfig = CreditConfig()

    def __post_init__(self) -> None:
        if not isinstance(self.advantage, AdvantageEstimator):
            raise ValueError(f"advantage must be an AdvantageEstimator, got {self.advantage!r}")
        if self.advantage.needs_values and self.value is None:
            raise ValueError(f"advantage kind {self.advantage.kind!r} needs a value head: set `value`")
        if self.value is not None and not self.advantage.needs_values:
            raise ValueError(f"`value` is set but advantage kind {self.advantage.kind!r} uses no value head")
        if not self.entropy_coef >= 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        self.credit.check_estimator(self.advantage)


def decode_hook(typ: type, obj: Any) -> Any:
    if typ is AdvantageEstimator:
        return advantage_from_dict(obj)
    raise NotImplementedError(f"cannot decode {typ}")


def _presets() -> dict[str, dict[str, Any]]:
    # One file defines the presets for every package: the run config (JAX-free, in rlax_core)
    # validates a preset's name against the same list the trainer builds objectives from.
    return objective_presets()


PRESET_NAMES: tuple[str, ...] = tuple(_presets())


def objective_from_dict(data: dict[str, Any]) -> ObjectiveConfig:
    """Build a config from a mapping; `base: <preset>` starts from a preset and overrides fields.

    Errors name the offending field path and value (msgspec.ValidationError, a ValueError).
    """
    if not isinstance(data, dict):
        raise ValueError(f"objective config must be a mapping, got {type(data).__name__}")
    return msgspec.convert(resolve_objective_dict(data), ObjectiveConfig, dec_hook=decode_hook)


def resolve_objective_dict(data: dict[str, Any]) -> dict[str, Any]:
    """Expand `base: <preset>` into the preset's fields merged with the given overrides."""
    data = dict(data)
    base = data.pop("base", None)
    if base is None:
        return data
    presets = _presets()
    if base not in presets:
        raise ValueError(f"unknown objective preset {base!r} (field `base`); known: {sorted(presets)}")
    return merge_objective(presets[base], data)


def preset(name: str, **overrides: Any) -> ObjectiveConfig:
    """A named preset (grpo, dapo, dr_grpo, rloo, reinforce, reinforce_pp, gspo, cispo, ppo)."""
    return objective_from_dict({"base": name, **overrides})


def load_objective(path: str | pathlib.Path) -> ObjectiveConfig:
    """Read a YAML file holding an objective config (optionally `base: <preset>` + overrides)."""
    path = pathlib.Path(path)
    try:
        return objective_from_dict(yaml.safe_load(path.read_text()) or {})
    except msgspec.ValidationError as e:
        raise msgspec.ValidationError(f"{path}: {e}") from None


def objective_to_dict(cfg: ObjectiveConfig) -> dict[str, Any]:
    """The plain-data form of a config (what `objective_from_dict` reads back)."""
    out: dict[str, Any] = msgspec.to_builtins(cfg)
    out["advantage"] = advantage_to_dict(cfg.advantage)
    return out


def shape_rewards(cfg: ObjectiveConfig, rewards: jax.Array, lengths: jax.Array) -> jax.Array:
    """rewards: [B], lengths: [B] response lengths -> rewards with overlong shaping applied."""
    rewards = rewards.astype(jnp.float32)
    if cfg.overlong is None:
        return rewards
    return rewards + overlong_penalty(cfg.overlong, lengths)


def overlong_penalty(o: OverlongConfig, lengths: jax.Array) -> jax.Array:
    """lengths: [B] response lengths -> [B] f32, the (non-positive) overlong reward term."""
    soft_start = o.max_length - o.cache_length
    lengths = lengths.astype(jnp.float32)
    ramp = (soft_start - lengths) / o.cache_length * o.penalty
    return jnp.where(lengths <= soft_start, 0.0, jnp.where(lengths <= o.max_length, ramp, -o.penalty))
