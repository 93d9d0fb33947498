"""`supervisor:` the restart policy of `rlax launch` and each role's interpreter."""

from __future__ import annotations

from rlax_core.config.base import ROLES, Section, check


class SupervisorSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Restart policy of `rlax launch`, and the Python interpreter of each role.

    `interpreters`: role -> the `python` of the environment that role's package is
    installed in (e.g. one virtual environment per node role); a role not named runs
    with the launching interpreter."""

    max_restarts: int = 20
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    stable_after_s: float = 60.0
    shutdown_grace_s: float = 10.0
    interpreters: dict[str, str] = {}

    def __post_init__(self) -> None:
        for role in self.interpreters:
            check(role in ROLES, "interpreters", role, f"roles are {', '.join(ROLES)}")
        check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "must be >= 0")
        check(self.backoff_initial_s > 0, "backoff_initial_s", self.backoff_initial_s, "must be > 0")
        check(
            self.backoff_max_s >= self.backoff_initial_s,
            "backoff_max_s",
            self.backoff_max_s,
            "must be >= backoff_initial_s",
        )
        check(self.shutdown_grace_s > 0, "shutdown_grace_s", self.shutdown_grace_s, "must be > 0")
