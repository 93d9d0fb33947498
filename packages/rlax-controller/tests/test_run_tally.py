"""RunTally: the one object the controller's parts count into."""

from __future__ import annotations

import pytest

from rlax_controller import run_tally
from rlax_controller.run_tally import RunTally


def test_counts_go_into_the_dict_it_was_given() -> None:
    counters = {"groups_completed": 2}
    tally = RunTally(counters)
    tally.count("groups_completed")
    tally.count("scoring_failures")
    tally.count("rollouts_trained", 8)
    assert counters == {"groups_completed": 3, "scoring_failures": 1, "rollouts_trained": 8}


class TickingClock:
    """`time.monotonic` that moves 0.25 s each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.25
        return self.now


def test_a_timed_block_adds_to_its_part_even_when_it_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_tally, "time", TickingClock())
    tally = RunTally({})
    with tally.timed("controller_score_seconds"):
        pass
    with pytest.raises(ValueError), tally.timed("controller_score_seconds"):
        raise ValueError("scorer failed")
    with tally.timed("controller_snapshot_seconds"):
        pass
    assert tally.step_seconds == {"controller_score_seconds": 0.5, "controller_snapshot_seconds": 0.25}


def test_closing_a_step_reports_its_fields_in_order_and_starts_the_next() -> None:
    tally = RunTally({"groups_completed": 4})
    tally.step_started = 100.0
    tally.add_generated(300)
    tally.add_generated(100)
    tally.step_seconds["controller_snapshot_seconds"] = 0.25
    fields = tally.close_step(102.0, queue_depth=3, inflight_groups=1)
    assert fields == {
        "gen_tokens_per_s": 200.0,
        "step_time_s": 2.0,
        "queue_depth": 3,
        "inflight_groups": 1,
        "groups_completed": 4,
        "controller_snapshot_seconds": 0.25,
    }
    assert list(fields) == [
        "gen_tokens_per_s", "step_time_s", "queue_depth", "inflight_groups", "groups_completed",
        "controller_snapshot_seconds",
    ]  # fmt: skip
    assert tally.step_started == 102.0 and tally.generated_tokens == 0 and tally.step_seconds == {}
    assert tally.close_step(102.0)["gen_tokens_per_s"] == 0.0  # no time passed: no division by zero
