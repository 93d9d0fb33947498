"""The verifier interface: a batch of (completion, record) in, one result per item out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from rlax_data.datasets import Record

__all__ = ["VerifyItem", "VerifyResult", "Verifier"]

VerifyItem = tuple[str, Record]
"""(completion text, the record it answers)."""


class VerifyResult(msgspec.Struct, frozen=True, kw_only=True):
    """Score of one completion.

    reward: the scalar the RL objective uses. correct: whether the answer is right
    (what pass@k counts). details: JSON-able diagnostics (extracted answer, failed cases).
    """

    reward: float
    correct: bool
    details: dict[str, Any] = {}


@runtime_checkable
class Verifier(Protocol):
    """Scores completions. Batched so that slow verifiers (code) can run items in parallel."""

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        """items: [batch] of (completion, record) -> [batch] results, in the same order."""
        ...
