"""`chaos:` killing components on purpose, to show that a run survives it."""

from __future__ import annotations

import msgspec

from rlax_core.config.base import Section, check


class ChaosSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Chaos mode: SIGKILL a random component every ~`interval` seconds (0: off).
    `max_delay_s`: every worker sleeps a random time up to this before each engine step
    and the trainer before each update (0: off), so tests can show that timing never
    changes a pinned run."""

    interval: float = 0.0
    seed: int = 0
    targets: list[str] = msgspec.field(
        default_factory=lambda: ["worker", "trainer", "controller", "paramserver"]
    )
    max_kills: int = 0
    max_delay_s: float = 0.0

    def __post_init__(self) -> None:
        check(self.interval >= 0, "interval", self.interval, "must be >= 0 seconds")
        check(self.max_delay_s >= 0, "max_delay_s", self.max_delay_s, "must be >= 0 seconds")
        check(self.max_kills >= 0, "max_kills", self.max_kills, "must be >= 0 (0: unlimited)")
        allowed = ("worker", "trainer", "controller", "paramserver", "verifier")
        for i, target in enumerate(self.targets):
            check(target in allowed, f"targets[{i}]", target, f"must be one of {', '.join(allowed)}")
