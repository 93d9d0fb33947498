"""`RunConfig`: the whole run, composed of one section per component.

Each section is defined once, in its own module of this package (JAX-free, so that a
controller node validates the trainer's section without installing the trainer); the
checks here are the ones that span sections.
"""

from __future__ import annotations

import pathlib

import msgspec

from rlax_core.config.addresses import AddressesSection
from rlax_core.config.agent import AgentSection
from rlax_core.config.base import Section, check
from rlax_core.config.chaos import ChaosSection
from rlax_core.config.controller import ControllerSection
from rlax_core.config.data import DataSection
from rlax_core.config.evaluation import EvalSection
from rlax_core.config.launcher import LauncherSection
from rlax_core.config.model import ModelSection
from rlax_core.config.paramserver import ParamServerSection
from rlax_core.config.run import RunSection
from rlax_core.config.security import SecuritySection
from rlax_core.config.supervisor import SupervisorSection
from rlax_core.config.trainer import TrainerSection
from rlax_core.config.verifier import VerifierSection
from rlax_core.config.workers import WorkersSection


class RunConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole run: one section per component."""

    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    data: DataSection = msgspec.field(default_factory=DataSection)
    agent: AgentSection = msgspec.field(default_factory=AgentSection)
    workers: WorkersSection = msgspec.field(default_factory=WorkersSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    paramserver: ParamServerSection = msgspec.field(default_factory=ParamServerSection)
    verifier: VerifierSection = msgspec.field(default_factory=VerifierSection)
    controller: ControllerSection = msgspec.field(default_factory=ControllerSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    chaos: ChaosSection = msgspec.field(default_factory=ChaosSection)
    supervisor: SupervisorSection = msgspec.field(default_factory=SupervisorSection)
    addresses: AddressesSection = msgspec.field(default_factory=AddressesSection)
    launcher: LauncherSection = msgspec.field(default_factory=LauncherSection)
    security: SecuritySection = msgspec.field(default_factory=SecuritySection)

    def __post_init__(self) -> None:
        # Batch s needs rollouts of version >= s - k while the newest version is s; a worker
        # reloads only once it is j behind, so it may generate with version s - j + 1. With
        # j > k + 1 every group it returns is too stale, is regenerated with the same
        # weights, and the run stops making progress without an error.
        j, k = self.workers.j, self.trainer.k
        check(
            j <= k + 1,
            "workers.j",
            j,
            f"must be <= trainer.k + 1 = {k + 1}: a worker {j} versions behind generates rollouts the "
            f"trainer (k={k}) rejects forever; lower workers.j or raise trainer.k",
        )
        check(
            self.agent.where == "local" or self.verifier.mode == "service",
            "agent.where",
            self.agent.where,
            "needs verifier.mode: service (the environments then run in the verifier service)",
        )
        check(
            self.trainer.lora is None or self.trainer.sft_steps == 0,
            "trainer.sft_steps",
            self.trainer.sft_steps,
            "must be 0 with trainer.lora: the adapters' base would be the SFT result, which a "
            "resumed trainer does not rebuild (not supported yet)",
        )
        if self.controller.versions == "pinned":
            lag = self.pinned_lag
            check(
                lag + j - 1 <= k,
                "controller.lag",
                self.controller.lag,
                f"with workers.j={j} a group of step s is generated with a version up to lag + j - 1 = "
                f"{lag + j - 1} behind s, more than trainer.k={k}; lower controller.lag or raise trainer.k",
            )
            check(
                self.paramserver.keep >= lag + j,
                "paramserver.keep",
                self.paramserver.keep,
                f"must be >= controller.lag + workers.j = {lag + j}: a pinned group may ask for a version "
                f"that many versions old",
            )

        if self.workers.on_new_version == "interrupt":
            self._check_partial_rollouts()
        check(
            self.workers.resume_kv == "recompute" or self.workers.on_new_version == "interrupt",
            "workers.resume_kv",
            self.workers.resume_kv,
            "keep needs workers.on_new_version: interrupt (only a resumed partial rollout keeps its K/V)",
        )

    def _check_partial_rollouts(self) -> None:
        why = "workers.on_new_version: interrupt (partial rollouts) needs"
        check(self.controller.versions == "pinned", "controller.versions", self.controller.versions,
              f"must be pinned: {why} the controller's version schedule")  # fmt: skip
        newest = self.workers.segment_newest_lag
        check(self.pinned_lag >= newest + 1, "controller.lag", self.controller.lag,
              f"must be >= workers.segment_newest_lag + 1 = {newest + 1} (resolved: {self.pinned_lag}): "
              f"{why} a newer version than the first segment's, at most s - {newest} for step s; "
              "below that every segment has one version")  # fmt: skip
        check(self.workers.j == 1, "workers.j", self.workers.j, f"must be 1: {why} every version")
        check(not self.agent.enabled, "agent.enabled", self.agent.enabled,
              f"must be false: {why} single-turn samples (a trajectory is not resumed)")  # fmt: skip
        check(self.partial_segment_tokens < self.data.max_new_tokens, "workers.segment_tokens",
              self.workers.segment_tokens,
              f"must be < data.max_new_tokens={self.data.max_new_tokens}: no sample would be interrupted")  # fmt: skip

    @property
    def partial_segment_tokens(self) -> int:
        """Tokens per segment of a partial rollout: `workers.segment_tokens`, or max_new_tokens
        split across the versions a group spans (s - lag to s - segment_newest_lag)."""
        versions = max(1, self.pinned_lag - self.workers.segment_newest_lag + 1)
        return self.workers.segment_tokens or -(-self.data.max_new_tokens // versions)

    @property
    def pinned_lag(self) -> int:
        """`controller.lag`, with -1 resolved to the most that trainer.k (k - j + 1) and
        paramserver.keep (keep - j) allow."""
        lag, j = self.controller.lag, self.workers.j
        return max(0, min(self.trainer.k - j + 1, self.paramserver.keep - j)) if lag < 0 else lag

    @property
    def lookahead_steps(self) -> int:
        """`controller.lookahead_steps`, with -1 resolved: the pinned lag (at least 1) under
        pinned versions, else 1."""
        ahead = self.controller.lookahead_steps
        if ahead >= 0:
            return ahead
        return max(1, self.pinned_lag) if self.controller.versions == "pinned" else 1

    def pinned_version(self, step: int) -> int:
        """The weight version that generates the groups of `step` under `controller.versions: pinned`."""
        j = self.workers.j
        return j * (max(0, step - self.pinned_lag) // j)

    @property
    def output_dir(self) -> pathlib.Path:
        return self.run.resolved_output_dir

    @property
    def batch_size(self) -> int:
        """Rollouts per training step: prompts_per_step groups of group_size."""
        return self.data.prompts_per_step * self.data.group_size
