"""The controller's evaluation of a step: which evaluation prompts are still to generate,
their scores, and the `eval` metrics record once every prompt is scored.

Each evaluated step also writes its per-problem results to
`<run>/eval_problems/step_<step:06d>.jsonl`, one JSON object per evaluation prompt in the
eval set's order (`PROBLEM_FIELDS`), so which problems fail can be read, not guessed from
pass@k: `jq 'select(.pass_rate == 0)' runs/<name>/eval_problems/step_000060.jsonl`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import numpy as np

from rlax_controller.metrics import MetricsWriter, trajectory_record
from rlax_controller.rollout_scheduler import PromptItem
from rlax_core.config import RunConfig
from rlax_data.pass_at_k import pass_at_k
from rlax_protocol.atomic_files import atomic_write_bytes
from rlax_protocol.messages import Sample

__all__ = ["PROBLEM_FIELDS", "EvalJob", "EvaluationJobs", "problems_path"]

log = logging.getLogger("rlax.controller")

PENDING = "pending"
DONE = "done"

PROBLEM_FIELDS: Final = (
    "step", "id", "prompt", "answer", "n", "correct", "pass_rate", "final_answers", "rewards",
    "sample_correct", "tool_calls", "tool_correct", "ends",
)  # fmt: skip
"""The fields of one per-problem row (and `pass@k` for each of `eval.pass_k`): the
record's prompt text and reference answer (None where the record has none), the number
of samples `n` and of correct ones, `pass_rate` = correct / n, and per sample (in sample
order) the final answer as decoded (of a trajectory: its last model turn; None without
a decoder), the reward, whether it is correct, its tool calls, whether its tool use was
correct (`Sample.tool_correct`, None where the environment cannot tell) and how it
ended (`Sample.end`, "" for a single-turn sample)."""


def problems_path(folder: str | pathlib.Path, step: int) -> pathlib.Path:
    """Where the per-problem results of the evaluation at `step` are written."""
    return pathlib.Path(folder) / "eval_problems" / f"step_{step:06d}.jsonl"


@dataclasses.dataclass
class EvalJob:
    step: int
    items: list[PromptItem]
    status: dict[int, str]  # item index -> "pending" | request id | "done"
    results: dict[int, list[tuple[float, bool]]] = dataclasses.field(default_factory=dict)
    versions: dict[int, int] = dataclasses.field(default_factory=dict)
    samples: dict[int, tuple[Sample, ...]] = dataclasses.field(default_factory=dict)  # for tool-use figures
    # Per prompt: each sample's final answer (its last model turn's token ids), for the per-problem file.
    completions: dict[int, tuple[tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.monotonic)


class EvaluationJobs:
    """At most one evaluation at a time, of the step the run is at.

    `run_evaluated` is called when the run's last step has been evaluated, or has nothing
    to evaluate: the controller then finishes the run. `decode` turns a sample's final
    answer (token ids) into text for the per-problem file (the run's task's `decode`);
    without it the file holds no answers' text (`final_answers` None).
    """

    def __init__(
        self,
        config: RunConfig,
        items: Sequence[PromptItem],
        metrics: MetricsWriter,
        *,
        run_evaluated: Callable[[], None],
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self.config = config
        self.items = list(items)
        self.metrics = metrics
        self.run_evaluated = run_evaluated
        self.decode = decode
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
        self,
        index: int,
        scores: list[tuple[float, bool]],
        version: int,
        samples: tuple[Sample, ...],
        completions: Sequence[Sequence[int]] = (),
    ) -> None:
        """Prompt `index` is scored; the last one writes the evaluation's record.

        completions: each sample's final answer as token ids (what was scored), for the
        per-problem file; () when not known."""
        job = self.job
        assert job is not None
        job.results[index] = scores
        job.versions[index] = version
        job.samples[index] = samples
        job.completions[index] = tuple(tuple(int(t) for t in c) for c in completions)
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
        # Before the history: a run killed in between evaluates the step again, rewriting the file.
        self._write_problems(job)
        self.history.append({k: v for k, v in record.items() if k != "kind"})
        log.info("eval at step %d: %s", job.step, {k: v for k, v in record.items() if k.startswith("pass@")})
        self.job = None
        if job.step >= self.config.run.steps:
            self.run_evaluated()

    def _write_problems(self, job: EvalJob) -> None:
        """The per-problem file of `job` (`PROBLEM_FIELDS`), written atomically. A file that
        cannot be written costs the run nothing but the file: it is logged, not raised."""
        n = self.config.eval.n_samples
        lines = []
        for index, item in enumerate(job.items):
            scores = job.results[index]
            samples = job.samples.get(index, ())
            completions = job.completions.get(index, ())
            correct = sum(bool(c) for _, c in scores)
            record = item.record
            prompt = getattr(record, "prompt", None)
            answer = getattr(record, "answer", None)
            row: dict[str, Any] = {
                "step": job.step,
                "id": item.prompt_id,
                "prompt": prompt if isinstance(prompt, str) else None,
                "answer": answer if isinstance(answer, str) else None,
                "n": len(scores),
                "correct": correct,
                "pass_rate": correct / len(scores) if scores else 0.0,
            }
            for k in self.config.eval.pass_k:
                row[f"pass@{k}"] = pass_at_k(n, correct, k) if len(scores) == n else None
            row["final_answers"] = (
                [self.decode(c) for c in completions]
                if self.decode is not None and len(completions) == len(scores)
                else None
            )
            row["rewards"] = [float(r) for r, _ in scores]
            row["sample_correct"] = [bool(c) for _, c in scores]
            row["tool_calls"] = [s.tool_calls for s in samples]
            row["tool_correct"] = [s.tool_correct for s in samples]
            row["ends"] = [s.end for s in samples]
            lines.append(json.dumps(row, ensure_ascii=False))
        path = problems_path(self.metrics.folder, job.step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"), fsync=False)
        except OSError as error:
            log.error("eval at step %d: cannot write the per-problem results %s: %s", job.step, path, error)
