"""RolloutResults with a real scheduler and evaluation jobs: results scored into groups and
evaluation prompts, and the work of lost requests and workers put back in the queue."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.metrics import MetricsWriter, read_metrics
from rlax_controller.partial_rollouts import SegmentPlan
from rlax_controller.rollout_results import RolloutResults
from rlax_controller.rollout_scheduler import (
    Group,
    GroupStatus,
    PromptItem,
    RolloutScheduler,
    RolloutSchedulerConfig,
)
from rlax_controller.run_tally import RunTally
from rlax_core.config import ConfigError, load_config
from rlax_protocol.errors import ProtocolTimeoutError, RemoteError
from rlax_protocol.messages import GenerateResult, Sample


class Scorer:
    """Reward 1 for an even first token; `error`, when set, is raised instead."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def score(self, item: PromptItem, completions: Sequence[tuple[int, ...]]) -> list[tuple[float, bool]]:
        if self.error is not None:
            raise self.error
        return [(float(c[0] % 2 == 0), c[0] % 2 == 0) for c in completions]


def result(tag: str, first_tokens: Sequence[int], version: int = 0, **sample: Any) -> GenerateResult:
    samples = tuple(
        Sample(token_ids=(t, 5, 7), logprobs=(-0.5,) * 3, finish_reason="stop", **sample)
        for t in first_tokens
    )
    return GenerateResult(request_id=tag, samples=samples, weight_version=version)


class Rig:
    def __init__(self, tmp_path: pathlib.Path, toy: Any, versions: str, segments: SegmentPlan) -> None:
        config = load_config(
            None, [f"run.output_dir={tmp_path / 'run'}", "eval.n_samples=2", "eval.pass_k=[1]", "run.steps=4"]
        )
        self.scheduler = RolloutScheduler(
            toy.Source(),
            RolloutSchedulerConfig(
                group_size=2,
                prompts_per_step=2,
                k=1,
                versions=versions,
                lookahead_steps=None,
                segments=segments,
            ),
        )
        self.tally = RunTally(self.scheduler.counters)
        self.metrics = MetricsWriter(config.output_dir, tensorboard=False)
        items = [PromptItem("e0", (9, 1)), PromptItem("e1", (9, 2))]
        self.evaluations = EvaluationJobs(config, items, self.metrics, run_evaluated=lambda: None)
        self.scorer = Scorer()
        self.results = RolloutResults(self.scheduler, self.evaluations, self.scorer, self.tally)

    def dispatched(self, worker: str = "worker0") -> list[Group]:
        return [group for _, group in self.scheduler.assign([worker])]


WHOLE_GROUPS = SegmentPlan()  # partial rollouts off


@pytest.fixture
def rig(tmp_path: pathlib.Path, toy: Any) -> Iterator[Any]:
    made: list[Rig] = []

    def make(versions: str = "freshest", segments: SegmentPlan = WHOLE_GROUPS) -> Rig:
        made.append(Rig(tmp_path, toy, versions, segments))
        return made[-1]

    yield make
    for r in made:
        r.metrics.close()


def test_a_result_completes_its_group_with_the_scorers_rewards(rig: Any) -> None:
    r = rig()
    group = r.dispatched()[0]
    r.results.take_result("worker0", result(group.request_id, [4, 3], version=0))
    assert group.status is GroupStatus.DONE and group.version == 0
    assert [(s.reward, s.correct) for s in group.samples] == [(1.0, True), (0.0, False)]
    assert r.tally.counters["groups_completed"] == 1 and r.tally.generated_tokens == 6
    assert "controller_score_seconds" in r.tally.step_seconds


def test_an_environments_reward_replaces_the_scorers(rig: Any) -> None:
    r = rig()
    group = r.dispatched()[0]
    r.results.take_result("worker0", result(group.request_id, [4, 3], env_reward=0.25))
    assert [s.reward for s in group.samples] == [0.25, 0.25]


def test_a_result_for_no_tracked_group_is_counted_ignored(rig: Any) -> None:
    r = rig()
    r.results.take_result("worker0", result("g99.a1.r1", [4, 4]))
    assert r.tally.counters["results_ignored"] == 1 and r.tally.counters["groups_completed"] == 0


def test_a_result_from_other_weights_than_pinned_sends_the_group_back(rig: Any) -> None:
    r = rig("pinned")
    group = r.dispatched()[0]
    assert group.pinned == 0
    r.results.take_result("worker0", result(group.request_id, [4, 4], version=1))
    assert group.status is GroupStatus.PENDING and r.tally.counters["wrong_version_results"] == 1


@pytest.mark.parametrize(
    "error",
    [ProtocolTimeoutError("verifier", "score", 1.0), RemoteError("overloaded", "busy"), TimeoutError()],
)
def test_a_verifier_that_is_down_sends_the_group_back(rig: Any, error: BaseException) -> None:
    r = rig()
    group = r.dispatched()[0]
    r.scorer.error = error
    r.results.take_result("worker0", result(group.request_id, [4, 4]))
    assert group.status is GroupStatus.PENDING and r.tally.counters["scoring_failures"] == 1


def test_a_verifier_without_a_route_for_the_task_stops_the_run(rig: Any) -> None:
    r = rig()
    group = r.dispatched()[0]
    r.scorer.error = RemoteError("not_found", "task='tool_arithmetic': not one of ['math']")
    with pytest.raises(ConfigError, match="verifier service cannot score.*tool_arithmetic"):
        r.results.take_result("worker0", result(group.request_id, [4, 4]))


def test_a_result_with_the_wrong_number_of_samples_sends_the_group_back(rig: Any) -> None:
    r = rig()
    group = r.dispatched()[0]
    r.results.take_result("worker0", result(group.request_id, [4, 4, 4]))
    assert group.status is GroupStatus.PENDING and r.tally.counters["groups_completed"] == 0


def test_evaluation_results_are_scored_into_their_job(rig: Any) -> None:
    r = rig()
    r.evaluations.start_if_due(0)
    r.evaluations.sent(0, "eval0.0.aaaaaa")
    r.evaluations.sent(1, "eval0.1.bbbbbb")
    r.results.take_result("worker0", result("eval0.9.cccccc", [4, 4]))  # no prompt of this job: ignored
    r.scorer.error = ProtocolTimeoutError("verifier", "score", 1.0)
    r.results.take_result("worker0", result("eval0.0.aaaaaa", [4, 4]))
    assert r.evaluations.pending() == [0]  # its scoring failed: generated again
    r.scorer.error = None
    r.evaluations.sent(0, "eval0.0.dddddd")
    r.results.take_result("worker0", result("eval0.0.dddddd", [4, 4], version=0))
    r.results.take_result("worker0", result("eval0.1.bbbbbb", [4, 3], version=0))
    (record,) = read_metrics(r.metrics.path, kind="eval")
    assert record["step"] == 0 and record["pass@1"] == pytest.approx(0.75)
    assert r.tally.counters["groups_completed"] == 0 and r.evaluations.job is None


def test_a_released_request_puts_its_group_or_prompt_back(rig: Any) -> None:
    r = rig()
    group = r.dispatched()[0]
    r.evaluations.start_if_due(0)
    r.evaluations.sent(1, "eval0.1.aaaaaa")
    r.results.release(group.request_id)
    r.results.release("eval0.1.aaaaaa")
    assert group.status is GroupStatus.PENDING and r.evaluations.pending() == [0, 1]


def test_a_lost_worker_loses_its_groups_and_evaluation_prompts(rig: Any) -> None:
    r = rig()
    mine = r.dispatched("worker0")
    theirs = r.dispatched("worker1")
    r.evaluations.start_if_due(0)
    r.evaluations.sent(0, "eval0.0.aaaaaa")
    r.evaluations.sent(1, "eval0.1.bbbbbb")
    r.results.worker_lost("worker0", ["eval0.0.aaaaaa", *(g.request_id for g in mine)])
    assert all(g.status is GroupStatus.PENDING for g in mine)
    assert all(g.status is GroupStatus.DISPATCHED for g in theirs)
    assert r.evaluations.pending() == [0] and r.tally.counters["groups_reassigned"] == len(mine)


def test_a_dispatched_group_no_worker_holds_a_request_for_goes_back(rig: Any) -> None:
    r = rig()
    held, orphan = r.dispatched()[:2]
    r.results.release_orphans({held.request_id})
    assert held.status is GroupStatus.DISPATCHED and orphan.status is GroupStatus.PENDING


def test_partial_rollouts_are_scored_once_every_sample_has_finished(rig: Any) -> None:
    """Segments of 2 tokens: after the first, sample 0 has stopped and sample 1 goes on; the
    scorer sees nothing until sample 1 stops in the second, then both whole samples."""
    r = rig("pinned", SegmentPlan(tokens=2, max_new_tokens=6, max_seq_len=64))
    group = r.dispatched()[0]
    first = GenerateResult(
        request_id=group.request_id or "",
        samples=(
            Sample(token_ids=(4,), logprobs=(-0.1,), finish_reason="stop"),
            Sample(token_ids=(3, 5), logprobs=(-0.2, -0.3), finish_reason="length"),
        ),
        weight_version=0,
    )
    r.scorer.error = AssertionError("scored before the group finished")
    r.results.take_result("worker0", first)
    assert group.status is GroupStatus.PENDING and group.segment == 1
    assert r.tally.counters["segments_resumed"] == 1 and r.tally.counters["samples_resumed"] == 1
    r.scorer.error = None
    assert r.dispatched() and group.status is GroupStatus.DISPATCHED
    tail = Sample(token_ids=(7,), logprobs=(-0.4,), finish_reason="stop")
    r.results.take_result(
        "worker0", GenerateResult(request_id=group.request_id or "", samples=(tail,), weight_version=0)
    )
    assert group.status is GroupStatus.DONE and group.version == 0
    assert [s.token_ids for s in group.samples] == [(4,), (3, 5, 7)]
    assert [s.logprobs for s in group.samples] == [(-0.1,), (-0.2, -0.3, -0.4)]
    assert [s.token_versions for s in group.samples] == [(0,), (0, 0, 0)]
    assert [s.reward for s in group.samples] == [1.0, 0.0]  # the scorer: an even first token
