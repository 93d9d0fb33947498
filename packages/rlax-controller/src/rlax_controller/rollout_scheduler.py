"""The controller's decisions, free of sockets and clocks: which prompt goes to which
worker, which scored groups form the batch of a step, what the snapshot holds.

Determinism under preemption rests on one rule: *prompt order is stream order*. Prompts
are drawn from the stream in order and every group carries the stream state after it
was drawn. The batch of step s takes groups strictly in stream order — the first
`prompts_per_step` groups after batch s-1 that pass the dynamic filter. A group that
became too stale (`s - version > k`) is regenerated with the same prompt, never skipped,
so timing can change *which weights* generated a group but never *which prompts* a step
consumes. The stream state after a batch's last group is the snapshot's stream state.

Pinned versions (`versions="pinned"`) take timing out of the weights as well: every group
consumed by step s is generated with version `pinned_version(s)`. Which step consumes a
group is known only once every earlier group is scored (dynamic filtering drops some), so
a group is dispatched with the version of the LATEST step it can land in (every earlier
group whose filter outcome is unknown counted as accepted), and a group whose final step
turns out earlier, with another version, is generated again. Every group a step consumes
is therefore generated with the same version on any machine, with any number of workers
and any kill schedule, and so are its samples: the trajectory is a function of the config
and seed.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rlax_controller.partial_rollouts import PartialSample, SegmentPlan, join_segment
from rlax_data.task_from_config import PromptItem
from rlax_protocol.messages import Sample

__all__ = [
    "Batch",
    "Group",
    "GroupStatus",
    "PromptItem",
    "PromptSource",
    "RolloutScheduler",
    "RolloutSchedulerConfig",
    "ScoredSample",
]


class PromptSource(Protocol):
    """A deterministic prompt stream whose whole state is a small JSON-able dict."""

    def next_prompt(self) -> PromptItem: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass(frozen=True)
class ScoredSample:
    """One generated, scored completion (token ids and the worker's logprobs per token), or a
    multi-turn trajectory with its model mask and tool counts. A trajectory's per-turn
    rewards (`turn_ends`: each model turn's last token; `turn_rewards`: its reward, the
    verifier's score included) sum to `reward`, the one figure of the sample that metrics,
    curation and dynamic filtering read."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    reward: float
    correct: bool
    # Multi-turn trajectories (`rlax_protocol.Sample`): 1 on the model's tokens (empty: all).
    model_mask: tuple[int, ...] = ()
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    end: str = ""
    turn_ends: tuple[int, ...] = ()
    turn_rewards: tuple[float, ...] = ()
    tool_correct: bool | None = None  # the environment's verdict (`rlax_protocol.Sample.tool_correct`)
    # Partial rollouts: the version that drew each token (empty: all the group's version).
    token_versions: tuple[int, ...] = ()


class GroupStatus(enum.Enum):
    PENDING = "pending"
    DISPATCHED = "dispatched"
    DONE = "done"


@dataclasses.dataclass
class Group:
    """The G samples of one prompt, from drawing to training."""

    index: int
    item: PromptItem
    seed: int
    stream_state_after: dict[str, Any]
    rng_state_after: dict[str, Any]
    status: GroupStatus = GroupStatus.PENDING
    worker: str | None = None
    request_id: str | None = None
    attempts: int = 0
    version: int | None = None
    pinned: int | None = None  # the version its request asks for (pinned versions)
    samples: tuple[ScoredSample, ...] = ()
    # Partial rollouts (`partial_rollouts`): the step its segments' versions are planned for,
    # the next segment, the samples so far, and each generated segment's version.
    pinned_step: int | None = None
    segment: int = 0
    partial: tuple[PartialSample, ...] = ()
    segment_versions: tuple[int, ...] = ()
    last_worker: str | None = None  # the worker of its last segment (`SegmentPlan.same_worker`)

    def unfinished(self, plan: SegmentPlan) -> list[int]:
        """Indices of the samples the next segment continues."""
        prompt_len = len(self.item.prompt_token_ids)
        return [i for i, p in enumerate(self.partial) if p.unfinished(plan, prompt_len)]

    @property
    def all_rewards_equal(self) -> bool:
        rewards = [s.reward for s in self.samples]
        return bool(rewards) and max(rewards) == min(rewards)

    def rollout_id(self, sample: int) -> str:
        return f"{self.item.prompt_id}#{self.index}/v{self.version}/{sample}"


@dataclasses.dataclass(frozen=True)
class RolloutSchedulerConfig:
    group_size: int
    prompts_per_step: int
    k: int
    dynamic_filter: bool = False
    max_filter_draws: int = 64
    max_inflight_per_worker: int = 2
    seed: int = 0
    # The defaults of the options a run sets are the run config's (`controller:`), so a
    # scheduler made by hand behaves as a run's does; `lag` and `lookahead_steps` are the
    # resolved ones (`RunConfig.pinned_lag`, `RunConfig.lookahead_steps`), never -1: the
    # section's -1 resolves to 1 at lag 0. None for `lookahead_steps`: k.
    lookahead_steps: int | None = 1
    versions: str = "pinned"  # or "freshest": see the module docstring
    lag: int = 0  # pinned: groups of step s use version j * floor(max(0, s - lag) / j)
    j: int = 1
    segments: SegmentPlan = SegmentPlan()  # partial rollouts; off by default

    def pinned_version(self, step: int) -> int:
        return self.j * (max(0, step - self.lag) // self.j)

    def segment_version(self, step: int, segment: int) -> int:
        """The version of segment `segment` of a group consumed by `step` (`partial_rollouts`);
        segment 0, and every segment without partial rollouts, is `pinned_version(step)`."""
        first = self.pinned_version(step)
        if not self.segments.enabled:
            return first
        return max(first, min(first + segment, step - self.segments.newest_lag))


@dataclasses.dataclass(frozen=True)
class Batch:
    """The groups of one training step, in stream order, and what they consumed."""

    step: int
    groups: tuple[Group, ...]
    consumed_indices: tuple[int, ...]
    consumed_prompt_ids: tuple[str, ...]
    filtered: int
    stream_state_after: dict[str, Any]
    rng_state_after: dict[str, Any]

    @property
    def rollout_ids(self) -> list[str]:
        return [g.rollout_id(i) for g in self.groups for i in range(len(g.samples))]

    @property
    def staleness(self) -> list[int]:
        return [self.step - (g.version or 0) for g in self.groups]


class BatchNotReady(Exception):
    """The head of the stream order is not scored yet (or was sent back for regeneration)."""


def _seed_from(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**31 - 1))


class RolloutScheduler:
    """Holds drawn-but-untrained groups and decides dispatch and batches (no I/O)."""

    def __init__(self, source: PromptSource, config: RolloutSchedulerConfig) -> None:
        self.source = source
        self.config = config
        self.rng = np.random.Generator(np.random.PCG64(config.seed))
        self.groups: OrderedDict[int, Group] = OrderedDict()
        self.next_index = 0
        self.step = 0
        self.base_stream_state: dict[str, Any] = source.state_dict()
        self.base_rng_state: dict[str, Any] = dict(self.rng.bit_generator.state)
        self.counters: dict[str, int] = {
            "prompts_drawn": 0,
            "groups_dispatched": 0,
            "groups_completed": 0,
            "groups_filtered": 0,
            "groups_expired": 0,
            "groups_reassigned": 0,
            "results_ignored": 0,
            "rollouts_generated": 0,
            "rollouts_trained": 0,
            "tokens_generated": 0,
            "segments_resumed": 0,
            "samples_resumed": 0,
        }
        self._by_request: dict[str, int] = {}
        self._request_counter = 0

    # -- restore ------------------------------------------------------------------------
    def restore(
        self,
        *,
        step: int,
        next_index: int,
        stream_state: dict[str, Any],
        rng_state: dict[str, Any],
        counters: dict[str, int],
    ) -> None:
        """Forget every drawn group and continue from a snapshot's boundary."""
        self.source.load_state_dict(stream_state)
        self.rng.bit_generator.state = rng_state
        self.base_stream_state = stream_state
        self.base_rng_state = rng_state
        self.groups.clear()
        self._by_request.clear()
        self.next_index = next_index
        self.step = step
        self.counters.update(counters)

    # -- drawing and dispatch -----------------------------------------------------------
    def _lookahead(self) -> int:
        # Weights of version `step` stay usable for batches step..step+k.
        ahead = (
            self.config.k
            if self.config.lookahead_steps is None
            else min(self.config.k, self.config.lookahead_steps)
        )
        return (ahead + 1) * self.config.prompts_per_step

    def _useful_groups(self) -> int:
        return sum(
            1 for g in self.groups.values() if not (g.status is GroupStatus.DONE and self._filtered(g))
        )

    def _filtered(self, group: Group) -> bool:
        return self.config.dynamic_filter and group.all_rewards_equal

    def draw_ahead(self) -> int:
        """Draw prompts until the lookahead window is full; returns how many were drawn."""
        drawn = 0
        while self._useful_groups() < self._lookahead():
            item = self.source.next_prompt()
            seed = _seed_from(self.rng)
            group = Group(
                index=self.next_index,
                item=item,
                seed=seed,
                stream_state_after=self.source.state_dict(),
                rng_state_after=dict(self.rng.bit_generator.state),
            )
            self.groups[group.index] = group
            self.next_index += 1
            self.counters["prompts_drawn"] += 1
            drawn += 1
        return drawn

    def inflight(self, worker: str) -> int:
        return sum(
            1 for g in self.groups.values() if g.status is GroupStatus.DISPATCHED and g.worker == worker
        )

    @property
    def pending(self) -> int:
        return sum(1 for g in self.groups.values() if g.status is GroupStatus.PENDING)

    @property
    def pinned(self) -> bool:
        return self.config.versions == "pinned"

    def latest_steps(self) -> dict[int, int]:
        """Group index -> the latest step that can consume it: groups are taken in stream
        order, `prompts_per_step` accepted ones a step, and a group not scored yet may still
        be accepted. Exact for a group once every earlier group is scored."""
        steps: dict[int, int] = {}
        step, accepted = self.step, 0
        for group in self.groups.values():
            steps[group.index] = step
            if group.status is GroupStatus.DONE and self._filtered(group):
                continue
            accepted += 1
            if accepted == self.config.prompts_per_step:
                step, accepted = step + 1, 0
        return steps

    def assign(self, workers: Sequence[str]) -> list[tuple[str, Group]]:
        """Hand pending groups (earliest first) to the least-loaded workers with room; with
        pinned versions, only groups whose version exists (the newest is `step`'s)."""
        self.draw_ahead()
        load = {w: self.inflight(w) for w in workers}
        latest = self.latest_steps() if self.pinned else {}
        out: list[tuple[str, Group]] = []
        for group in self.groups.values():
            if group.status is not GroupStatus.PENDING:
                continue
            if self.pinned:
                if group.segment and group.pinned_step != latest[group.index]:
                    # An earlier group was filtered: this one lands sooner, on other versions.
                    self.release(group)
                if not group.segment:
                    group.pinned_step = latest[group.index]
                assert group.pinned_step is not None
                version = self.config.segment_version(group.pinned_step, group.segment)
                if version > self.step:
                    continue  # not trained yet
                group.pinned = version
            room = [w for w in workers if load[w] < self.config.max_inflight_per_worker]
            if not room:
                break
            worker = min(room, key=lambda w: (load[w], w))
            last = group.last_worker
            if group.segment and self.config.segments.same_worker and last is not None and last in room:
                worker = last  # it holds the K/V of the samples so far
            load[worker] += 1
            self._request_counter += 1
            group.status = GroupStatus.DISPATCHED
            group.worker = worker
            group.attempts += 1
            group.request_id = f"g{group.index}.a{group.attempts}.r{self._request_counter}"
            self._by_request[group.request_id] = group.index
            self.counters["groups_dispatched"] += 1
            out.append((worker, group))
        return out

    def worker_lost(self, worker: str) -> list[Group]:
        """A worker died: its dispatched groups go back to pending (another worker takes them),
        those of an `assign()` whose requests were not sent yet included: a caller that is
        still walking that assignment must skip them (their `request_id` is None now)."""
        lost = [g for g in self.groups.values() if g.status is GroupStatus.DISPATCHED and g.worker == worker]
        for group in lost:
            self.release(group)
            self.counters["groups_reassigned"] += 1
        return lost

    def release(self, group: Group) -> None:
        """Send a group back to the queue (its generation or scoring failed)."""
        if group.request_id is not None:
            self._by_request.pop(group.request_id, None)
        group.status = GroupStatus.PENDING
        group.worker = None
        group.request_id = None
        group.version = None
        group.pinned = None
        group.samples = ()
        group.pinned_step = None
        group.segment = 0
        group.last_worker = None
        group.partial = ()
        group.segment_versions = ()

    def group_for_request(self, request_id: str) -> Group | None:
        index = self._by_request.get(request_id)
        return None if index is None else self.groups.get(index)

    def add_segment(
        self, request_id: str, version: int, samples: Sequence[Sample]
    ) -> list[PartialSample] | None:
        """Partial rollouts: join a segment's samples to its group. Returns the group's whole
        samples once none is left unfinished (then `complete` it with their scores); else None,
        and the group waits for its next segment's version (a late or unknown result, or a
        wrong count, is ignored, the latter sending the group back)."""
        group = self._dispatched(request_id)
        if group is None:
            return None
        plan = self.config.segments
        continued = group.unfinished(plan)
        expected = len(continued) if group.partial else self.config.group_size
        if len(samples) != expected:
            self.release(group)
            raise ValueError(f"request {request_id}: {len(samples)} samples, expected {expected}")
        group.partial = tuple(join_segment(group.partial, continued, samples, version))
        group.segment_versions += (version,)
        if not group.unfinished(plan):
            return list(group.partial)
        self._by_request.pop(request_id, None)
        group.status = GroupStatus.PENDING
        group.last_worker = group.worker
        group.worker = group.request_id = group.pinned = None
        group.segment += 1
        self.counters["segments_resumed"] += 1
        self.counters["samples_resumed"] += len(group.unfinished(plan))
        return None

    def _dispatched(self, request_id: str) -> Group | None:
        group = self.group_for_request(request_id)
        if group is None or group.status is not GroupStatus.DISPATCHED or group.request_id != request_id:
            self.counters["results_ignored"] += 1
            return None
        return group

    def complete(self, request_id: str, version: int, samples: Sequence[ScoredSample]) -> Group | None:
        """Record the scored samples of a request; a late or unknown result is ignored (None).
        With partial rollouts `version` is the first segment's (the oldest)."""
        group = self._dispatched(request_id)
        if group is None:
            return None
        if len(samples) != self.config.group_size:
            raise ValueError(
                f"request {request_id}: {len(samples)} samples, expected group_size={self.config.group_size}"
            )
        self._by_request.pop(request_id, None)
        group.status = GroupStatus.DONE
        group.version = version
        group.segment_versions = group.segment_versions or (version,)
        group.samples = tuple(samples)
        self.counters["groups_completed"] += 1
        self.counters["rollouts_generated"] += len(samples)
        self.counters["tokens_generated"] += sum(len(s.token_ids) for s in samples)
        return group

    # -- batches ------------------------------------------------------------------------
    def build_batch(self) -> Batch:
        """The batch of the current step, or `BatchNotReady`. Too-stale groups at the head
        are sent back for regeneration (same prompt, same seed)."""
        accepted: list[Group] = []
        consumed: list[Group] = []
        filtered = 0
        for group in self.groups.values():
            if group.status is not GroupStatus.DONE:
                raise BatchNotReady(f"group {group.index} is {group.status.value}")
            assert group.version is not None
            planned = tuple(
                self.config.segment_version(self.step, i) for i in range(len(group.segment_versions))
            )
            if self.pinned and group.segment_versions != planned:
                # Dispatched for a later step (an earlier group was filtered since): the
                # versions of this step's groups are others; generate it again with those.
                self.counters["groups_repinned"] = self.counters.get("groups_repinned", 0) + 1
                why = (
                    f"group {group.index} was generated with versions {list(group.segment_versions)}; "
                    f"step {self.step} uses {list(planned)}"
                )
                self.release(group)
                raise BatchNotReady(why)
            if self.step - group.version > self.config.k:
                self.counters["groups_expired"] += 1
                self.release(group)
                raise BatchNotReady(
                    f"group {group.index} expired (version {group.version}, step {self.step})"
                )
            consumed.append(group)
            if self._filtered(group):
                filtered += 1
                if filtered > self.config.max_filter_draws:
                    raise RuntimeError(
                        f"dynamic filtering dropped {filtered} groups in a row at step {self.step} "
                        f"(data.max_filter_draws={self.config.max_filter_draws}): every group's rewards are equal; "
                        "the task is too easy or too hard for the model"
                    )
                continue
            accepted.append(group)
            if len(accepted) == self.config.prompts_per_step:
                last = consumed[-1]
                return Batch(
                    step=self.step,
                    groups=tuple(accepted),
                    consumed_indices=tuple(g.index for g in consumed),
                    consumed_prompt_ids=tuple(g.item.prompt_id for g in consumed),
                    filtered=filtered,
                    stream_state_after=last.stream_state_after,
                    rng_state_after=last.rng_state_after,
                )
        self.draw_ahead()
        raise BatchNotReady("not enough groups drawn yet")

    def commit(self, batch: Batch) -> None:
        """The trainer finished `batch`: drop its groups and move the boundary to step+1."""
        if batch.step != self.step:
            raise ValueError(f"commit of batch for step {batch.step} while at step {self.step}")
        for index in batch.consumed_indices:
            group = self.groups.pop(index, None)
            if group is not None and group.request_id is not None:
                self._by_request.pop(group.request_id, None)
        self.counters["groups_filtered"] += batch.filtered
        self.counters["rollouts_trained"] += sum(len(g.samples) for g in batch.groups)
        self.base_stream_state = batch.stream_state_after
        self.base_rng_state = batch.rng_state_after
        self.step += 1

    @property
    def boundary_index(self) -> int:
        """Stream index of the first group not yet consumed by a committed batch."""
        return next(iter(self.groups), self.next_index)


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from any parts (stable across processes, unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
