"""Partial rollouts decided by the controller's schedule (`rlax_controller.partial_rollouts`):
segment versions written out by hand; a scheduler run in which a stand-in worker answers the
very requests the dispatch builds (first segments, then `ResumedSample`s) gives the same
batches, tokens and per-token versions whatever order groups finish in and however many
workers there are; a late segment and a lost worker leave nothing behind."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from test_rollout_scheduler import ShuffledSource

from rlax_controller.partial_rollouts import SegmentPlan, segment_request
from rlax_controller.rollout_results import scored_sample
from rlax_controller.rollout_scheduler import (
    BatchNotReady,
    Group,
    GroupStatus,
    RolloutScheduler,
    RolloutSchedulerConfig,
)
from rlax_protocol.messages import GenerateRequest, GenerateResult, Sample, SamplingParams

PLAN = SegmentPlan(tokens=4, max_new_tokens=12, max_seq_len=64)


def config(**fields: Any) -> RolloutSchedulerConfig:
    base: dict[str, Any] = {
        "group_size": 4,
        "prompts_per_step": 3,
        "k": 2,
        "max_inflight_per_worker": 3,
        "seed": 3,
        "versions": "pinned",
        "lag": 2,
        "lookahead_steps": 2,
        "dynamic_filter": True,
        "segments": PLAN,
    }
    return RolloutSchedulerConfig(**{**base, **fields})


def test_segment_versions_follow_the_schedule_written_out_by_hand() -> None:
    """lag 2: step s's first segment on s - 2, the rest on s - 1; lag 3: s - 3, s - 2, then
    s - 1; never below version 0, never version s itself; off: one version. Newest lag 2:
    never s - 1 either, so the last segment overlaps step s - 1's training."""
    lag2, lag3 = config(lag=2), config(lag=3, k=3)
    assert [[lag2.segment_version(s, i) for i in range(4)] for s in range(5)] == [
        [0, 0, 0, 0],
        [0, 0, 0, 0],
        [0, 1, 1, 1],
        [1, 2, 2, 2],
        [2, 3, 3, 3],
    ]
    assert [lag3.segment_version(6, i) for i in range(5)] == [3, 4, 5, 5, 5]
    assert [config(segments=SegmentPlan()).segment_version(6, i) for i in range(3)] == [4, 4, 4]
    overlapped = config(lag=3, k=3, segments=dataclasses.replace(PLAN, newest_lag=2))
    assert [[overlapped.segment_version(s, i) for i in range(3)] for s in (2, 3, 6)] == [
        [0, 0, 0],
        [0, 1, 1],
        [3, 4, 4],
    ]


def length_of(seed: int, index: int) -> int:
    """A long-tailed sample length in 1..12 (a function of the group's seed and sample)."""
    return min(PLAN.max_new_tokens, 1 + int(random.Random(f"{seed}/{index}").paretovariate(1.1)) % 13)


def generate(request: GenerateRequest, version: int) -> GenerateResult:
    """A stand-in worker: token t of sample i is a function of (seed, i, t, version), and a
    sample stops at its length; it continues resumed samples from their tokens."""
    seed = request.sampling.seed
    assert seed is not None
    starts = [(r.sample_index, len(r.token_ids)) for r in request.resume] or [
        (i, 0) for i in range(request.n)
    ]
    samples = []
    for index, start in starts:
        end = min(length_of(seed, index), start + request.sampling.max_tokens)
        tokens = tuple(
            random.Random(f"{seed}/{index}/{t}/{version}").randrange(10, 60) for t in range(start, end)
        )
        reason = "stop" if end == length_of(seed, index) and end < PLAN.max_new_tokens else "length"
        samples.append(Sample(token_ids=tokens, logprobs=(-0.5,) * len(tokens), finish_reason=reason))
    return GenerateResult(request_id=request.request_id, samples=tuple(samples), weight_version=version)


def request_of(sched: RolloutScheduler, group: Group) -> GenerateRequest:
    assert group.request_id is not None
    whole = GenerateRequest(
        request_id=group.request_id,
        prompt_token_ids=group.item.prompt_token_ids,
        sampling=SamplingParams(max_tokens=PLAN.max_new_tokens, seed=group.seed),
        n=4,
        weight_version=group.pinned,
    )
    return segment_request(whole, group.partial, group.unfinished(PLAN), PLAN)


def take(sched: RolloutScheduler, group: Group, result: GenerateResult) -> None:
    """What `RolloutResults` does with a segment's result: join it; score a finished group."""
    assert group.request_id is not None
    joined = sched.add_segment(group.request_id, result.weight_version, result.samples)
    if joined is None:
        return
    scored = [scored_sample(p.as_sample(), float(sum(p.token_ids) % 2), False, p.versions) for p in joined]
    sched.complete(group.request_id, group.segment_versions[0], scored)


def simulate(
    order_seed: int, workers: int, steps: int = 10, cfg: RolloutSchedulerConfig | None = None
) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """The batches, and the scheduler's counters plus how many continued segments went to the
    worker of their group's last segment (`kept`) or to another (`moved`)."""
    sched = RolloutScheduler(ShuffledSource(n=40), cfg or config())
    order = random.Random(order_seed)
    names = [f"w{i}" for i in range(workers)]
    running: list[Group] = []
    batches: list[tuple[Any, ...]] = []
    placed = {"kept": 0, "moved": 0}
    while sched.step < steps:
        for worker, group in sched.assign(names):
            if group.segment:
                placed["kept" if worker == group.last_worker else "moved"] += 1
            running.append(group)
        order.shuffle(running)
        for group in running[: order.randint(0, len(running))]:  # some answer, in any order
            assert group.pinned is not None and group.pinned <= sched.step  # trained already
            take(sched, group, generate(request_of(sched, group), group.pinned))
        running = [g for g in running if g.status is GroupStatus.DISPATCHED]
        try:
            batch = sched.build_batch()
        except BatchNotReady:
            continue
        for group in batch.groups:
            for sample in group.samples:
                # Token t's version is the schedule's for its segment: a function of (step, t).
                planned = tuple(
                    sched.config.segment_version(batch.step, t // PLAN.tokens)
                    for t in range(len(sample.token_ids))
                )
                assert sample.token_versions == planned
                assert all(batch.step - sched.config.k <= v < max(batch.step, 1) for v in planned)
        batches.append(
            (
                batch.step,
                batch.consumed_prompt_ids,
                tuple(s.token_ids for g in batch.groups for s in g.samples),
                tuple(s.token_versions for g in batch.groups for s in g.samples),
            )
        )
        sched.commit(batch)
    return batches, {**sched.counters, **placed}


def test_partial_batches_do_not_depend_on_the_order_segments_finish_in() -> None:
    reference, counters = simulate(order_seed=0, workers=2)
    # The test has teeth: samples were resumed, and some crossed a version within one sample.
    assert counters["segments_resumed"] > 10 and counters["samples_resumed"] > counters["segments_resumed"]
    assert any(len(set(v)) > 1 for _, _, _, versions in reference for v in versions)
    assert any(len(t) <= PLAN.tokens for _, _, tokens, _ in reference for t in tokens)  # and some did not
    for seed in range(1, 8):
        assert simulate(order_seed=seed, workers=1 + seed % 3)[0] == reference


def test_with_kept_kv_a_groups_next_segment_goes_to_the_worker_of_its_last() -> None:
    """`workers.resume_kv: keep` (`SegmentPlan.same_worker`): a continued segment goes where
    its samples' K/V are while that worker has room; the batches are the same either way."""
    roomy = {"max_inflight_per_worker": 50}
    spread, spread_counts = simulate(0, workers=3, cfg=config(**roomy))
    same, same_counts = simulate(
        0, workers=3, cfg=config(**roomy, segments=dataclasses.replace(PLAN, same_worker=True))
    )
    assert spread_counts["moved"] > 0  # least-loaded placement moves segments: the test has teeth
    assert same_counts["moved"] == 0 and same_counts["kept"] > 10
    assert same == spread


def test_a_lost_segment_is_generated_again_and_a_late_one_is_ignored() -> None:
    sched = RolloutScheduler(ShuffledSource(n=40), config(lag=2, dynamic_filter=False))
    long = next(
        g
        for _, g in sched.assign(["w0"])
        if not g.partial and any(length_of(g.seed, i) > PLAN.tokens for i in range(4))
    )
    first = generate(request_of(sched, long), long.pinned or 0)
    take(sched, long, first)
    assert long.status is GroupStatus.PENDING and long.segment == 1
    sched.assign(["w0", "w1"])
    assert long.status is GroupStatus.DISPATCHED and long.pinned == 0 and long.segment == 1
    stale_tag = long.request_id
    sched.worker_lost(long.worker or "")
    assert long.status is GroupStatus.PENDING and long.partial == () and long.segment == 0
    ignored = sched.counters["results_ignored"]
    assert sched.add_segment(stale_tag or "", 1, first.samples) is None
    assert sched.counters["results_ignored"] == ignored + 1


def test_a_segment_with_the_wrong_number_of_samples_sends_its_group_back() -> None:
    sched = RolloutScheduler(ShuffledSource(n=40), config(dynamic_filter=False))
    _, group = sched.assign(["w0"])[0]
    assert group.request_id is not None
    with pytest.raises(ValueError, match="3 samples, expected 4"):
        sched.add_segment(group.request_id, 0, generate(request_of(sched, group), 0).samples[:3])
    assert group.status is GroupStatus.PENDING and group.partial == ()
