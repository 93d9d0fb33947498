"""`verifier:` where rollouts are scored."""

from __future__ import annotations

from typing import Literal

from rlax_core.config.base import AUTO, Section, check, check_address


class VerifierSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`local`: the controller scores rollouts in-process; `service`: an `rlax verifier` process."""

    mode: Literal["local", "service"] = "local"
    address: str = AUTO
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_address("address", self.address)
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
