"""What becomes of the workers' work: results are scored into their group (the scheduler)
or their evaluation prompt; the work of a lost request or worker goes back to the queue."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from typing import Protocol

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.rollout_scheduler import GroupStatus, PromptItem, RolloutScheduler, ScoredSample
from rlax_controller.run_tally import RunTally
from rlax_core.config import ConfigError
from rlax_data.agent_turns import last_model_turn
from rlax_protocol.errors import ProtocolError, RemoteError
from rlax_protocol.messages import GenerateResult, Sample

__all__ = ["EVAL_TAG_PREFIX", "RolloutResults", "RolloutScorer", "scored_sample"]

log = logging.getLogger("rlax.controller")

EVAL_TAG_PREFIX = "eval"
"""Evaluation requests are tagged eval<step>.<prompt>.<nonce>; the scheduler tags its groups otherwise."""


class RolloutScorer(Protocol):
    """Scores the completions of one prompt: one (reward, correct) per completion."""

    def score(self, item: PromptItem, completions: Sequence[tuple[int, ...]]) -> list[tuple[float, bool]]: ...


def scored_sample(
    sample: Sample, verifier_reward: float, correct: bool, token_versions: tuple[int, ...] = ()
) -> ScoredSample:
    """A worker's sample with its reward. The environment's reward of the last step
    (`Sample.env_reward`) when it gave one, else the verifier's score of the final answer,
    is the last turn's reward; a trajectory's `reward` is the sum of its turns' rewards
    (without per-turn rewards: that one reward, as before)."""
    final = verifier_reward if sample.env_reward is None else sample.env_reward
    turn_rewards = list(sample.turn_rewards)
    if turn_rewards and sample.env_reward is None:
        # The worker sent 0.0 for a last turn whose step gave no reward: the score is paid there.
        turn_rewards[-1] += verifier_reward
    reward = math.fsum(turn_rewards) if turn_rewards else final
    return ScoredSample(
        tuple(sample.token_ids),
        tuple(sample.logprobs),
        sample.finish_reason,
        reward,
        correct,
        model_mask=tuple(sample.model_mask),
        turns=sample.turns,
        tool_calls=sample.tool_calls,
        tool_errors=sample.tool_errors,
        end=sample.end,
        turn_ends=tuple(sample.turn_ends),
        turn_rewards=tuple(turn_rewards),
        tool_correct=sample.tool_correct,
        token_versions=token_versions,
    )


class RolloutResults:
    """The worker pool's `WorkOwner`: takes its results, hears of its lost requests."""

    def __init__(
        self,
        scheduler: RolloutScheduler,
        evaluations: EvaluationJobs,
        scorer: RolloutScorer,
        tally: RunTally,
    ) -> None:
        self.scheduler = scheduler
        self.evaluations = evaluations
        self.scorer = scorer
        self.tally = tally

    def take_result(self, worker: str, result: GenerateResult) -> None:
        self.tally.add_generated(
            sum(sum(s.model_mask) if s.model_mask else len(s.token_ids) for s in result.samples)
        )
        if result.request_id.startswith(EVAL_TAG_PREFIX):
            self._take_eval_result(result, self._completions(result.samples))
            return
        group = self.scheduler.group_for_request(result.request_id)
        if group is None:
            self.tally.count("results_ignored")
            return
        if group.pinned is not None and result.weight_version != group.pinned:
            log.error(
                "%s generated %s with version %d, asked for %d; the group goes back to the queue",
                worker,
                result.request_id,
                result.weight_version,
                group.pinned,
            )
            self.tally.count("wrong_version_results")
            self.scheduler.release(group)
            return
        samples = list(result.samples)
        versions: list[tuple[int, ...]] = [()] * len(samples)
        if self.scheduler.config.segments.enabled:
            try:
                joined = self.scheduler.add_segment(result.request_id, result.weight_version, result.samples)
            except ValueError as error:  # a worker that answered with the wrong number of samples
                log.error("%s: %s; the group goes back to the queue", worker, error)
                return
            if joined is None:
                return  # its unfinished samples wait for the next segment's version
            samples = [p.as_sample() for p in joined]
            versions = [p.versions for p in joined]
        completions = self._completions(samples)
        try:
            with self.tally.timed("controller_score_seconds"):
                scores = self._score(group.item, completions)
        except (ProtocolError, TimeoutError) as error:
            # A verifier service that is down: generate this group again later.
            log.error("scoring %s failed (%s); the group goes back to the queue", result.request_id, error)
            self.tally.count("scoring_failures")
            self.scheduler.release(group)
            return
        scored = [
            scored_sample(s, float(r), bool(c), v)
            for s, (r, c), v in zip(samples, scores, versions, strict=True)
        ]
        try:
            self.scheduler.complete(
                result.request_id,
                group.segment_versions[0] if group.segment_versions else result.weight_version,
                scored,
            )
        except ValueError as error:  # a worker that answered with the wrong number of samples
            log.error("%s: %s; the group goes back to the queue", worker, error)
            self.scheduler.release(group)

    @staticmethod
    def _completions(samples: Sequence[Sample]) -> list[tuple[int, ...]]:
        """A trajectory's final answer is its last model turn."""
        return [last_model_turn(s.token_ids, s.model_mask) for s in samples]

    def _take_eval_result(self, result: GenerateResult, completions: list[tuple[int, ...]]) -> None:
        index = self.evaluations.prompt_of(result.request_id)
        if index is None:
            return  # its evaluation is over, or was dropped with a restore
        job = self.evaluations.job
        assert job is not None
        try:
            scores = self._score(job.items[index], completions)
        except (ProtocolError, TimeoutError) as error:
            log.error("scoring evaluation prompt %d failed (%s); it will be generated again", index, error)
            self.evaluations.retry(index)
            return
        self.evaluations.record(index, scores, result.weight_version, result.samples, completions)

    def _score(self, item: PromptItem, completions: list[tuple[int, ...]]) -> list[tuple[float, bool]]:
        """The scorer's rewards; a verifier service without a route for the item's task
        stops the run with a config error, since no retry could score it."""
        try:
            return self.scorer.score(item, completions)
        except RemoteError as error:
            if error.code == "not_found":
                raise ConfigError(
                    f"verifier: the verifier service cannot score this run's task: {error}"
                ) from None
            raise

    # -- lost work -----------------------------------------------------------------------------
    def release(self, tag: str) -> None:
        group = self.scheduler.group_for_request(tag)
        if group is not None:
            self.scheduler.release(group)
        else:
            self.evaluations.release([tag])

    def worker_lost(self, worker: str, tags: Collection[str]) -> None:
        self.scheduler.worker_lost(worker)
        self.evaluations.release(tags)

    def release_orphans(self, live_tags: Collection[str]) -> None:
        """A group marked dispatched whose request no worker link holds can never complete."""
        for group in list(self.scheduler.groups.values()):
            if group.status is GroupStatus.DISPATCHED and group.request_id not in live_tags:
                log.warning("group %d had no live request; back to the queue", group.index)
                self.scheduler.release(group)
