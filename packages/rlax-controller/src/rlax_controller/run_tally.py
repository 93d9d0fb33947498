"""The one place the controller's parts count into.

Before, the controller bumped the run's counters three different ways (a helper, a
``get(name, 0) + 1`` spelled out, and a bare ``+= 1`` that only works on the keys the
scheduler pre-fills); every part now reports through `RunTally`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["RunTally"]


class RunTally:
    """The run's counters, the seconds each controller part spent this step, and the tokens
    generated since the last commit.

    `counters` is the scheduler's own dict (the same object, not a copy): the scheduler
    counts its decisions into it, snapshots carry it and a restore updates it in place, so
    one dict holds every count of the run.
    """

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self.step_seconds: dict[str, float] = {}
        self.generated_tokens = 0
        self.step_started = time.monotonic()

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Adds the block's wall time to this step's `part` (a metrics field name)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.step_seconds[part] = self.step_seconds.get(part, 0.0) + time.monotonic() - started

    def add_generated(self, tokens: int) -> None:
        self.generated_tokens += tokens

    def close_step(self, now: float, **gauges: Any) -> dict[str, Any]:
        """The step's rate and time, `gauges` (in their order), the counters and the seconds
        by part, as fields of the step's metrics record; the next step starts at `now`."""
        elapsed = now - self.step_started
        fields: dict[str, Any] = {
            "gen_tokens_per_s": self.generated_tokens / max(elapsed, 1e-9),
            "step_time_s": elapsed,
            **gauges,
            **self.counters,
            **self.step_seconds,
        }
        self.step_seconds = {}
        self.generated_tokens = 0
        self.step_started = now
        return fields
