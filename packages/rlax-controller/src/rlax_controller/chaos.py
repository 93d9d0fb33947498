"""Chaos mode of both launch backends: which component to SIGKILL, and when.

Kills come every ~`chaos.interval` seconds (uniformly 0.5 to 1.5 times it), seeded by
`chaos.seed`; each round of kills visits every targeted role once, in a shuffled order, so
a short run still hits all of them. The backend does the killing; the schedule only
chooses, so a seed picks the same victims whichever backend runs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from rlax_core.config import ChaosSection

__all__ = ["ChaosSchedule"]


class ChaosSchedule:
    """The seeded schedule of chaos kills and the kills made so far (process, role)."""

    def __init__(self, chaos: ChaosSection) -> None:
        self.config = chaos
        self.rng = random.Random(chaos.seed)
        self.round: list[str] = []
        self.next_kill = 0.0
        self.kills: list[tuple[str, str]] = []

    def schedule(self, now: float) -> None:
        """Set the moment of the next kill, from `now`."""
        self.next_kill = now + self.config.interval * self.rng.uniform(0.5, 1.5)

    def kills_of(self, name: str) -> int:
        return sum(1 for killed, _ in self.kills if killed == name)

    def pick(
        self, now: float, roles: Sequence[str], running: Callable[[str], list[str]]
    ) -> tuple[str, str] | None:
        """The (process, role) to kill now, or None: chaos is off, not due, over
        `chaos.max_kills`, or no process of the round's next role runs (it is restarting:
        the caller asks again at its next tick). `roles`: the role of every process;
        `running(role)`: the processes of `role` that run now and may be killed. The pick
        is recorded and the next kill scheduled."""
        chaos = self.config
        if chaos.interval <= 0 or now < self.next_kill:
            return None
        if chaos.max_kills and len(self.kills) >= chaos.max_kills:
            return None
        targets = sorted({role for role in roles if role in chaos.targets})
        if not targets:
            return None
        if not self.round:
            self.round = self.rng.sample(targets, len(targets))
        candidates = running(self.round[0])
        if not candidates:
            return None
        role = self.round.pop(0)
        victim = self.rng.choice(candidates)
        self.kills.append((victim, role))
        self.schedule(now)
        return victim, role
