"""`eval:` evaluation on held-out prompts."""

from __future__ import annotations

import msgspec

from rlax_core.config.base import Section, check


class EvalSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Evaluation on held-out prompts: every `every` steps (0: only at start and end)."""

    every: int = 0
    num_prompts: int = 32
    n_samples: int = 8
    pass_k: list[int] = msgspec.field(default_factory=lambda: [1, 8])
    temperature: float = 1.0
    seed: int = 12345

    def __post_init__(self) -> None:
        check(self.every >= 0, "every", self.every, "must be >= 0")
        check(self.num_prompts >= 0, "num_prompts", self.num_prompts, "must be >= 0 (0: no evaluation)")
        check(self.n_samples >= 1, "n_samples", self.n_samples, "must be >= 1")
        for i, k in enumerate(self.pass_k):
            check(1 <= k <= self.n_samples, f"pass_k[{i}]", k, f"must be in [1, n_samples={self.n_samples}]")
