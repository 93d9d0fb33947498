"""EvaluationJobs: when a step is evaluated, its prompts' states, and its record."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.metrics import MetricsWriter, read_metrics
from rlax_controller.rollout_scheduler import PromptItem
from rlax_core.config import load_config
from rlax_protocol.messages import Sample

ITEMS = [PromptItem(f"e{i}", (9, i + 1)) for i in range(3)]


class Rig:
    def __init__(self, tmp_path: pathlib.Path, items: list[PromptItem], **extra: Any) -> None:
        overrides = {
            "run.output_dir": tmp_path / "run",
            "run.steps": 6,
            "eval.every": 3,
            "eval.n_samples": 2,
            "eval.pass_k": "[1,2]",
            **extra,
        }
        self.config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
        self.metrics = MetricsWriter(self.config.output_dir, tensorboard=False)
        self.finished = 0
        self.jobs = EvaluationJobs(self.config, items, self.metrics, run_evaluated=self._evaluated)

    def _evaluated(self) -> None:
        self.finished += 1

    def score_all(self, version: int = 3) -> None:
        sample = Sample(token_ids=(3, 4), logprobs=(-0.5, -0.5), finish_reason="stop")
        for index in self.jobs.pending():
            self.jobs.sent(index, f"eval.{index}")
            correct = index == 0
            self.jobs.record(index, [(float(correct), correct), (0.0, False)], version, (sample, sample))


@pytest.fixture
def rig(tmp_path: pathlib.Path) -> Iterator[Any]:
    made: list[Rig] = []

    def make(items: list[PromptItem] = ITEMS, **extra: Any) -> Rig:
        made.append(Rig(tmp_path, items, **extra))
        return made[-1]

    yield make
    for r in made:
        r.metrics.close()


def test_steps_zero_every_and_last_are_evaluated_once(rig: Any) -> None:
    r = rig()
    started = []
    for step in range(7):
        r.jobs.start_if_due(step)
        if r.jobs.job is not None:
            started.append(step)
            r.score_all()
    assert started == [0, 3, 6] and [e["step"] for e in r.jobs.history] == [0, 3, 6]
    r.jobs.start_if_due(3)  # already recorded (a rewind to step 3): not evaluated again
    assert r.jobs.job is None and r.finished == 1


def test_the_record_has_pass_at_k_reward_and_versions(rig: Any) -> None:
    r = rig()
    r.jobs.start_if_due(3)
    assert r.jobs.holds(3) and not r.jobs.holds(4) and r.jobs.pending() == [0, 1, 2]
    r.score_all(version=3)
    (record,) = read_metrics(r.metrics.path, kind="eval")
    assert record["step"] == 3 and record["num_prompts"] == 3
    assert record["pass@1"] == pytest.approx(1 / 6) and record["pass@2"] == pytest.approx(1 / 3)
    assert record["reward_mean"] == pytest.approx(1 / 6)
    assert (record["version_min"], record["version_max"]) == (3, 3)
    assert not r.jobs.holds(3) and r.finished == 0  # not the last step


def test_lost_and_failed_prompts_are_generated_again(rig: Any) -> None:
    r = rig()
    r.jobs.start_if_due(0)
    for index in (0, 1, 2):
        r.jobs.sent(index, f"tag{index}")
    assert r.jobs.pending() == [] and r.jobs.prompt_of("tag1") == 1
    r.jobs.release(["tag0", "tag2"])  # their worker was lost
    assert r.jobs.pending() == [0, 2]
    r.jobs.retry(1)  # its scoring failed
    assert r.jobs.pending() == [0, 1, 2] and r.jobs.prompt_of("tag1") is None


def test_a_restore_keeps_the_snapshots_history_and_drops_the_running_job(rig: Any) -> None:
    r = rig()
    r.jobs.start_if_due(0)
    r.jobs.restore([{"step": 0, "pass@1": 0.5}, {"step": 3, "pass@1": 0.75}])
    assert r.jobs.job is None and r.jobs.pending() == []
    r.jobs.start_if_due(3)
    assert r.jobs.job is None


@pytest.mark.parametrize("case", ["no items", "no prompts"])
def test_a_run_with_nothing_to_evaluate_is_evaluated_at_its_last_step(rig: Any, case: str) -> None:
    r = rig([]) if case == "no items" else rig(**{"eval.num_prompts": 0})
    for step in range(6):
        r.jobs.start_if_due(step)
    assert r.finished == 0
    r.jobs.start_if_due(6)
    assert r.finished == 1 and r.jobs.job is None


def test_the_last_steps_evaluation_ends_the_run_once_scored(rig: Any) -> None:
    r = rig()
    r.jobs.start_if_due(6)
    assert r.finished == 0
    r.score_all(version=6)
    assert r.finished == 1
