"""`run:` the run's identity and length."""

from __future__ import annotations

import pathlib
import re

from rlax_core.config.base import Section, check


class RunSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Identity and length of the run. `jax_cache_dir`: JAX's persistent compilation cache
    (empty: `<output_dir>/jax_cache`), so restarted processes skip recompiling."""

    name: str = "rlax-run"
    output_dir: str = "runs/{name}"
    seed: int = 0
    steps: int = 20
    log_every: int = 1
    jax_cache_dir: str = ""

    def __post_init__(self) -> None:
        check(
            bool(re.match(r"^[A-Za-z0-9_.-]+$", self.name)), "name", self.name, "letters, digits, _ . - only"
        )
        check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        check(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        check(self.seed >= 0, "seed", self.seed, "must be >= 0")

    @property
    def resolved_output_dir(self) -> pathlib.Path:
        return pathlib.Path(self.output_dir.format(name=self.name))
