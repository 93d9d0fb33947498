"""`controller:` the controller's endpoint, heartbeats and which weights generate a group."""

from __future__ import annotations

from typing import Literal

from rlax_core.config.base import AUTO, Section, check, check_address


class ControllerSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`lookahead_steps`: how many batches beyond the current one are generated ahead
    (capped by trainer.k). -1 (the default): under `pinned` versions, as many as the
    versions allow, the lag (at least 1): the groups of step s + lag can start once version
    s exists, and generating them early changes no token, only when the work is done
    (where generation has hardware of its own and its times vary, a deeper queue keeps the
    trainer fed; on the 2-core demo it measured the same as 1: docs/benchmarks.md); under
    `freshest`, 1, where more keeps workers busier and fewer keeps rollouts fresher.

    `versions`: which weights generate a group. `pinned` (the default): the controller
    decides, by the group's place in the stream alone: the groups of step s are generated
    with version `j * floor(max(0, s - lag) / j)`, sent in the request, so the run's batches
    and weights are a function of the config and seed whatever the machine's load, the
    number of workers or the kills. `freshest`: each worker generates with the newest
    weights it holds (reloading when `workers.j` behind), fresher but timing-dependent.
    `lag`: how many versions behind its step a group is generated under `pinned` (0:
    synchronous; -1: the most that trainer.k and paramserver.keep allow,
    min(k - j + 1, keep - j)).

    `request_timeout_s`: a request unanswered that long is sent elsewhere and its worker
    (alive: it answers pings) kept out of work for a while. `first_result_timeout_s` takes
    its place until a worker's first result of each life: that result waits for the
    worker's first compilation of the run's shapes (~45-60 s for the demo on 2 busy cores,
    minutes for a real model), which is not a hang."""

    address: str = AUTO
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 20.0
    request_timeout_s: float = 30.0
    first_result_timeout_s: float = 300.0
    snapshot_keep: int = 4
    lookahead_steps: int = -1
    versions: Literal["pinned", "freshest"] = "pinned"
    lag: int = -1

    def __post_init__(self) -> None:
        check_address("address", self.address)
        check(self.heartbeat_interval_s > 0, "heartbeat_interval_s", self.heartbeat_interval_s, "must be > 0")
        check(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s,
            f"must exceed heartbeat_interval_s={self.heartbeat_interval_s}",
        )
        check(self.request_timeout_s > 0, "request_timeout_s", self.request_timeout_s, "must be > 0")
        check(
            self.first_result_timeout_s > 0,
            "first_result_timeout_s",
            self.first_result_timeout_s,
            "must be > 0",
        )
        check(self.snapshot_keep >= 2, "snapshot_keep", self.snapshot_keep, "must be >= 2")
        check(
            self.lookahead_steps >= -1,
            "lookahead_steps",
            self.lookahead_steps,
            "must be >= 0, or -1 for the lag",
        )
        check(self.lag >= -1, "lag", self.lag, "must be >= 0, or -1 for the most trainer.k allows")
