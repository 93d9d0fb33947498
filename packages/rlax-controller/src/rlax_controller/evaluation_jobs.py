"""The controller's evaluation of a step: which evaluation prompts are still to generate,
their scores, and the `eval` metrics record once every prompt is scored."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from rlax_controller.metrics import MetricsWriter, trajectory_record
from rlax_controller.rollout_scheduler import PromptItem
from rlax_core.config import RunConfig
from rlax_data.pass_at_k import pass_at_k
from rlax_protocol.messages import Sample

__all__ = ["EvalJob", "EvaluationJobs"]

log = logging.getLogger("rlax.controller")

PENDING = "pending"
DONE = "done"


@dataclasses.dataclass
class EvalJob:
    step: int
    items: list[PromptItem]
    status: dict[int, str]  # item index -> "pending" | request id | "done"
    results: dict[int, list[tuple[float, bool]]] = dataclasses.field(default_factory=dict)
    versions: dict[int, int] = dataclasses.field(default_factory=dict)
    samples: dict[int, tuple[Sample, ...]] = dataclasses.field(default_factory=dict)  # for tool-use figures
    started: float = dataclasses.field(default_factory=time.monotonic)


class EvaluationJobs:
    """At most one evaluation at a time, of the step the run is at.

    `run_evaluated` is called when the run's last step has been evaluated, or has nothing
    to evaluate: the controller then finishes the run.
    """

    def __init__(
        self,
        config: RunConfig,
        items: Sequence[PromptItem],
        metrics: MetricsWriter,
        *,
        run_evaluated: Callable[[], None],
    ) -> None:
        self.config = config
        self.items = list(items)
        self.metrics = metrics
        self.run_evaluated = run_evaluated
        self.job: EvalJob | None = None
        self.history: list[dict[str, Any]] = []  # one record per evaluated step (snapshots carry it)

    def restore(self, history: Sequence[dict[str, Any]]) -> None:
        """Continue from a snapshot: its evaluations are done, a running one is dropped."""
        self.history = list(history)
        self.job = None

    def holds(self, step: int) -> bool:
        """Whether an evaluation of `step` is running (weights `step` must stay until it is scored)."""
        return self.job is not None and self.job.step == step

    def start_if_due(self, step: int) -> None:
        last = self.config.run.steps
        every = self.config.eval.every
        due = step == 0 or step >= last or (every and step % every == 0)
        if due and not any(e.get("step") == step for e in self.history):
            self._start(step)
        elif step >= last:
            self.run_evaluated()

    def _start(self, step: int) -> None:
        if not self.items or self.config.eval.num_prompts == 0:
            if step >= self.config.run.steps:
                self.run_evaluated()
            return
        if self.holds(step):
            return
        self.job = EvalJob(step=step, items=self.items, status=dict.fromkeys(range(len(self.items)), PENDING))

    # -- requests ------------------------------------------------------------------------
    def pending(self) -> list[int]:
        """The running evaluation's prompts that no worker is generating."""
        if self.job is None:
            return []
        return [index for index, status in self.job.status.items() if status == PENDING]

    def sent(self, index: int, tag: str) -> None:
        assert self.job is not None
        self.job.status[index] = tag

    def prompt_of(self, tag: str) -> int | None:
        if self.job is None:
            return None
        return next((i for i, status in self.job.status.items() if status == tag), None)

    def release(self, tags: Collection[str]) -> None:
        """The requests `tags` are lost: their prompts are generated again."""
        if self.job is None:
            return
        for index, status in self.job.status.items():
            if status in tags:
                self.job.status[index] = PENDING

    def retry(self, index: int) -> None:
        assert self.job is not None
        self.job.status[index] = PENDING

    def record(
        self, index: int, scores: list[tuple[float, bool]], version: int, samples: tuple[Sample, ...]
    ) -> None:
        """Prompt `index` is scored; the last one writes the evaluation's record."""
        job = self.job
        assert job is not None
        job.results[index] = scores
        job.versions[index] = version
        job.samples[index] = samples
        job.status[index] = DONE
        if all(s == DONE for s in job.status.values()):
            self._finish(job)

    def _finish(self, job: EvalJob) -> None:
        n = self.config.eval.n_samples
        record: dict[str, Any] = {"kind": "eval", "step": job.step}
        corrects = [sum(c for _, c in job.results[i]) for i in range(len(job.items))]
        for k in self.config.eval.pass_k:
            record[f"pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in corrects]))
        record["reward_mean"] = float(np.mean([r for i in range(len(job.items)) for r, _ in job.results[i]]))
        record.update(trajectory_record([s for samples in job.samples.values() for s in samples]))
        record["version_min"] = min(job.versions.values())
        record["version_max"] = max(job.versions.values())
        record["num_prompts"] = len(job.items)
        record["seconds"] = time.monotonic() - job.started
        self.metrics.write(record)
        self.history.append({k: v for k, v in record.items() if k != "kind"})
        log.info("eval at step %d: %s", job.step, {k: v for k, v in record.items() if k.startswith("pass@")})
        self.job = None
        if job.step >= self.config.run.steps:
            self.run_evaluated()
