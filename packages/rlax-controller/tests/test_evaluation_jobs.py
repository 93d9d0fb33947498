"""EvaluationJobs: when a step is evaluated, its prompts' states, and its record."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from rlax_controller.evaluation_jobs import PROBLEM_FIELDS, EvaluationJobs, problems_path
from rlax_controller.metrics import MetricsWriter, read_metrics
from rlax_controller.rollout_scheduler import PromptItem
from rlax_core.config import load_config
from rlax_data.datasets import Record
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


def test_each_evaluation_writes_its_problems_results(rig: Any) -> None:
    records = [Record(id=f"p{i}", prompt=f"{i}*7=", answer=str(i * 7)) for i in (3, 12)]
    items = [PromptItem(r.id, (9, i + 1), record=r) for i, r in enumerate(records)]
    r = rig(items)
    r.jobs.decode = lambda ids: "".join(chr(ord("0") + t) for t in ids)  # digits as token ids
    r.jobs.start_if_due(3)
    # Problem p3 is solved by one sample of two (its tool use judged right); p12 by none.
    answers = {0: [(2, 1), (2, 2)], 1: [(8, 4), (8, 5)]}
    judged = {0: (True, False), 1: (False, False)}
    for index in r.jobs.pending():
        r.jobs.sent(index, f"eval.{index}")
        samples = tuple(
            Sample(
                token_ids=(1,), logprobs=(), finish_reason="stop", tool_calls=1, end="answer", tool_correct=j
            )
            for j in judged[index]
        )
        scores = [(1.0, True), (0.0, False)] if index == 0 else [(0.0, False), (0.0, False)]
        r.jobs.record(index, scores, 3, samples, answers[index])
    path = problems_path(r.config.output_dir, 3)
    assert path == r.config.output_dir / "eval_problems" / "step_000003.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["id"] for row in rows] == ["p3", "p12"]
    first, second = rows
    assert set(PROBLEM_FIELDS) <= set(first) and {"pass@1", "pass@2"} <= set(first)
    assert (first["prompt"], first["answer"], first["final_answers"]) == ("3*7=", "21", ["21", "22"])
    assert (first["correct"], first["pass_rate"], first["pass@1"], first["pass@2"]) == (1, 0.5, 0.5, 1.0)
    assert (first["rewards"], first["sample_correct"]) == ([1.0, 0.0], [True, False])
    assert (first["tool_calls"], first["tool_correct"], first["ends"]) == (
        [1, 1],
        [True, False],
        ["answer"] * 2,
    )
    assert (second["answer"], second["final_answers"], second["pass_rate"]) == ("84", ["84", "85"], 0.0)


def test_problems_without_records_or_a_decoder_still_get_a_row(rig: Any) -> None:
    r = rig()
    r.jobs.start_if_due(0)
    r.score_all(version=0)
    rows = [json.loads(line) for line in problems_path(r.config.output_dir, 0).read_text().splitlines()]
    assert [row["id"] for row in rows] == ["e0", "e1", "e2"]
    assert all(row["prompt"] is None and row["final_answers"] is None for row in rows)
    assert [row["correct"] for row in rows] == [1, 0, 0]
