"""Reward shaping around a base verifier: format reward and DAPO's overlong penalty."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import msgspec

from rlax_data.verify.base import Verifier, VerifyItem, VerifyResult

__all__ = ["OverlongConfig", "ShapingConfig", "ShapedVerifier", "overlong_penalty"]


def overlong_penalty(length: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens.

    0 up to `max_tokens - cache_tokens`, then falling linearly to -1 at `max_tokens`,
    and -1 beyond it.
    """
    if not 0 <= cache_tokens <= max_tokens:
        raise ValueError(f"overlong: need 0 <= cache_tokens <= max_tokens, got {cache_tokens}, {max_tokens}")
    free = max_tokens - cache_tokens
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return (free - length) / cache_tokens
    return -1.0


class OverlongConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int
    cache_tokens: int
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.cache_tokens <= self.max_tokens:
            raise ValueError(
                f"field `overlong.cache_tokens`: must be in (0, max_tokens={self.max_tokens}], got {self.cache_tokens}"
            )


class ShapingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """reward = correct_weight * base reward + format_reward * [completion matches
    format_regex] + factor * overlong_penalty(length)."""

    correct_weight: float = 1.0
    format_regex: str | None = None
    format_reward: float = 0.0
    overlong: OverlongConfig | None = None

    def __post_init__(self) -> None:
        if self.format_regex is not None:
            try:
                re.compile(self.format_regex)
            except re.error as e:
                raise ValueError(f"field `format_regex`: invalid regular expression ({e})") from None


class ShapedVerifier:
    """Wraps a verifier; `correct` stays the base verifier's verdict, only the reward changes.

    length_fn: completion -> number of tokens (a tokenizer's encode length; `len` counts
    characters, which is exact for a character-level tokenizer).
    """

    def __init__(self, base: Verifier, config: ShapingConfig, length_fn: Callable[[str], int] = len) -> None:
        self.base = base
        self.config = config
        self.length_fn = length_fn
        self._format = re.compile(config.format_regex, re.DOTALL) if config.format_regex else None

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        c = self.config
        out = []
        for (completion, _), res in zip(items, self.base.verify(items), strict=True):
            reward = c.correct_weight * res.reward
            details = dict(res.details)
            if self._format is not None:
                fmt_ok = self._format.fullmatch(completion) is not None
                reward += c.format_reward * fmt_ok
                details["format_ok"] = fmt_ok
            if c.overlong is not None:
                n = self.length_fn(completion)
                pen = c.overlong.factor * overlong_penalty(n, c.overlong.max_tokens, c.overlong.cache_tokens)
                reward += pen
                details["length"] = n
                details["overlong_penalty"] = pen
            out.append(VerifyResult(reward=reward, correct=res.correct, details=details))
        return out
