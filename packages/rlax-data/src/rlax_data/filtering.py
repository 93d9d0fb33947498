"""DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["DynamicFilter"]

G = TypeVar("G")


def _identity(group: Any) -> Sequence[float]:
    return group  # type: ignore[no-any-return]


class DynamicFilter(Generic[G]):
    """Keeps groups whose rewards are not all equal, and counts what it drops.

    rewards_of: group -> its rewards ([G] floats); the default treats a group as its
    reward sequence. atol: rewards within `atol` of each other count as equal.
    Counters accumulate across calls; `state_dict()` / `load_state_dict()` carry them
    through a snapshot.
    """

    def __init__(
        self, rewards_of: Callable[[G], Sequence[float]] | None = None, *, atol: float = 0.0
    ) -> None:
        if atol < 0:
            raise ValueError(f"atol: must be >= 0, got {atol}")
        self.rewards_of: Callable[[G], Sequence[float]] = rewards_of or _identity
        self.atol = atol
        self.seen = 0
        self.kept = 0
        self.dropped_all_equal = 0
        self.dropped_by_value: dict[str, int] = {}

    def keep(self, rewards: Sequence[float]) -> bool:
        """Whether one group (rewards: [G] float) has any spread."""
        r = np.asarray(rewards, dtype=np.float64)
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"rewards: expected a non-empty 1-D group, got shape {r.shape}")
        return bool(r.max() - r.min() > self.atol)

    def __call__(self, groups: Sequence[G]) -> list[G]:
        """The groups worth training on, in order."""
        out = []
        for g in groups:
            rewards = self.rewards_of(g)
            self.seen += 1
            if self.keep(rewards):
                self.kept += 1
                out.append(g)
            else:
                self.dropped_all_equal += 1
                key = f"{float(rewards[0]):g}"
                self.dropped_by_value[key] = self.dropped_by_value.get(key, 0) + 1
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "seen": self.seen,
            "kept": self.kept,
            "dropped_all_equal": self.dropped_all_equal,
            "dropped_by_value": dict(self.dropped_by_value),
            "keep_rate": self.kept / self.seen if self.seen else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "kept": self.kept, "dropped_by_value": dict(self.dropped_by_value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])
        self.kept = int(state["kept"])
        self.dropped_by_value = {str(k): int(v) for k, v in state["dropped_by_value"].items()}
        self.dropped_all_equal = sum(self.dropped_by_value.values())
