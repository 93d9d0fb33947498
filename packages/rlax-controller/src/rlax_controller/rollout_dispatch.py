"""Sends work to the workers with room: the running evaluation's prompts first, then the
groups the scheduler assigns. Each becomes one `GenerateRequest`."""

from __future__ import annotations

import uuid

import msgspec

from rlax_controller.evaluation_jobs import EvaluationJobs
from rlax_controller.partial_rollouts import segment_request
from rlax_controller.rollout_results import EVAL_TAG_PREFIX
from rlax_controller.rollout_scheduler import Group, PromptItem, RolloutScheduler, stable_seed
from rlax_controller.worker_pool import WorkerPool, WorkerState
from rlax_core.config import RunConfig
from rlax_protocol.messages import AgentSpec, GenerateRequest, SamplingParams

__all__ = ["RolloutDispatch"]


class RolloutDispatch:
    def __init__(
        self,
        config: RunConfig,
        *,
        scheduler: RolloutScheduler,
        evaluations: EvaluationJobs,
        pool: WorkerPool,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.evaluations = evaluations
        self.pool = pool
        self.stop_token_ids = stop_token_ids

    def dispatch(self, now: float) -> None:
        ready = self.pool.ready(now)
        if not ready:
            return
        self._dispatch_evaluation(ready)
        if self.scheduler.step >= self.config.run.steps:
            return  # the run is trained; only the final evaluation remains
        cap = self.config.workers.max_inflight_groups
        names = [w.name for w in ready if len(w.requests) < cap]
        unreachable: set[str] = set()
        for name, group in self.scheduler.assign(names):
            if name in unreachable:
                continue  # released with its worker: see below
            worker = self.pool.workers[name]
            assert group.request_id is not None
            request = self._group_request(group)
            if not self.pool.send(worker, request):
                # Declared dead, the worker loses every group dispatched to it: this one, those
                # it held, and the rest of this same assignment (not sent, already released).
                unreachable.add(name)
                self.pool.declare_dead(worker, "it is not connected", reopen=False)

    def _group_request(self, group: Group) -> GenerateRequest:
        """A group's request: all its samples, or with partial rollouts its next segment
        (`partial_rollouts`): the first `segments.tokens` tokens of every sample, then the
        next ones of those not finished yet."""
        assert group.request_id is not None
        sampling = self._sampling(temperature=self.config.data.temperature, seed=group.seed)
        request = self._request(
            group.request_id, group.item, self.config.data.group_size, sampling, group.pinned
        )
        plan = self.scheduler.config.segments
        if not plan.enabled:
            return request
        return segment_request(request, group.partial, group.unfinished(plan), plan)

    def _dispatch_evaluation(self, ready: list[WorkerState]) -> None:
        job = self.evaluations.job
        if job is None:
            return
        cap = self.config.workers.max_inflight_groups
        for index in self.evaluations.pending():
            room = [w for w in ready if len(w.requests) < cap]
            if not room:
                break
            worker = min(room, key=lambda w: len(w.requests))
            tag = f"{EVAL_TAG_PREFIX}{job.step}.{index}.{uuid.uuid4().hex[:6]}"
            sampling = self._sampling(
                temperature=self.config.eval.temperature, seed=stable_seed(self.config.eval.seed, index)
            )
            # Pinned: the evaluation of step s measures version s (the trainer waits for it).
            version = job.step if self.scheduler.pinned else None
            request = self._request(tag, job.items[index], self.config.eval.n_samples, sampling, version)
            if self.pool.send(worker, request):
                self.evaluations.sent(index, tag)

    def _sampling(self, *, temperature: float, seed: int) -> SamplingParams:
        data = self.config.data
        return SamplingParams(
            max_tokens=data.max_new_tokens,
            temperature=temperature,
            top_p=data.top_p,
            top_k=data.top_k,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
            logprobs=True,
        )

    def _request(
        self, tag: str, item: PromptItem, n: int, sampling: SamplingParams, version: int | None
    ) -> GenerateRequest:
        return GenerateRequest(
            request_id=tag,
            prompt_token_ids=item.prompt_token_ids,
            sampling=sampling,
            n=n,
            weight_version=version,
            agent=self._agent_spec(item),
        )

    def _agent_spec(self, item: PromptItem) -> AgentSpec | None:
        """Multi-turn rollouts: the environment, the prompt's record and the limits."""
        agent = self.config.agent
        if not agent.enabled:
            return None
        return AgentSpec(
            environment=agent.environment,
            record=msgspec.json.encode(item.record).decode(),
            max_turns=agent.max_turns,
            max_total_tokens=agent.max_total_tokens or self.config.model.max_seq_len,
            tool_timeout_s=agent.tool_timeout_s,
        )
