"""Partial rollouts (`workers.on_new_version: interrupt`): a group's samples are generated in
segments of `segment_tokens` tokens, each segment with the version the controller's schedule
names, so a long sample crosses weight updates instead of holding its worker on old weights.

Where a sample is interrupted and which version continues it are decided by the schedule,
never by timing: segment i of a group consumed by step s is generated with version

    segment_version(s, i) = max(v, min(v + i, s - n)),   v = pinned_version(s) = s - lag

(n = `newest_lag`, `workers.segment_newest_lag`) so with lag L a sample's first segment uses
s - L, the next s - L + 1, ..., and the rest s - n: never version s, which only exists once
step s - 1 is trained (the batch of step s would wait for it). With n = 1 the last segment
can start only when step s - 1 is trained, while the trainer waits for it; n = 2 leaves it
step s - 1's training to run beside. A worker still holds one version at a time and drains
its engine before loading the next, but a drain now waits for at most one segment, not for
the longest sample: the tail of step s runs on version s - 1 beside the first segments of
step s + 1.
The samples that are not finished after a segment are sent again as `ResumedSample`s; a
worker continues each from its tokens so far with the newer weights (the KV cache of the
partial sequence is recomputed with them) and from the same place in its random stream, so
the tokens are a function of the config and seed, as with whole groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec

from rlax_protocol.messages import GenerateRequest, ResumedSample, Sample

__all__ = ["PartialSample", "SegmentPlan", "join_segment", "segment_request"]


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """`tokens`: a segment's length (0: partial rollouts off, a group is one request);
    `max_new_tokens` / `max_seq_len`: where a sample ends anyway (`data.max_new_tokens`,
    `model.max_seq_len`), so a segment that stopped there is not resumed. `newest_lag`: the
    newest version a segment of step s may use is s - newest_lag. `same_worker`: a group's
    next segment goes to the worker that generated its last one while that worker has room
    (`workers.resume_kv: keep`: the K/V of its samples so far are there)."""

    tokens: int = 0
    max_new_tokens: int = 0
    max_seq_len: int = 0
    newest_lag: int = 1
    same_worker: bool = False

    @property
    def enabled(self) -> bool:
        return self.tokens > 0

    def max_tokens(self, generated: int) -> int:
        """`SamplingParams.max_tokens` of the next segment of samples with `generated` tokens."""
        return min(self.tokens, self.max_new_tokens - generated)


@dataclasses.dataclass(frozen=True)
class PartialSample:
    """One sample of a group so far: its tokens, their logprobs under the weights that drew
    them, and those weights' version per token."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str

    def unfinished(self, plan: SegmentPlan, prompt_len: int) -> bool:
        """Stopped by its segment's length alone: neither a stop nor either limit."""
        return (
            self.finish_reason == "length"
            and len(self.token_ids) < plan.max_new_tokens
            and prompt_len + len(self.token_ids) < plan.max_seq_len
        )

    def resumed(self, index: int) -> ResumedSample:
        return ResumedSample(sample_index=index, token_ids=self.token_ids)

    def as_sample(self) -> Sample:
        return Sample(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
        )


def join_segment(
    partial: Sequence[PartialSample], continued: Sequence[int], samples: Sequence[Sample], version: int
) -> list[PartialSample]:
    """`partial` with the new tokens of `samples` (one per index in `continued`, in that order)
    appended; with no `partial` yet, the group's first segment: one sample per index."""
    if not partial:
        return [
            PartialSample(s.token_ids, s.logprobs, (version,) * len(s.token_ids), s.finish_reason)
            for s in samples
        ]
    joined = list(partial)
    for index, sample in zip(continued, samples, strict=True):
        head = joined[index]
        joined[index] = PartialSample(
            head.token_ids + sample.token_ids,
            head.logprobs + sample.logprobs,
            head.versions + (version,) * len(sample.token_ids),
            sample.finish_reason,
        )
    return joined


def segment_request(
    request: GenerateRequest, partial: Sequence[PartialSample], continued: Sequence[int], plan: SegmentPlan
) -> GenerateRequest:
    """The next segment of a group whose whole request is `request`: the first `plan.tokens`
    tokens of every sample (no `partial` yet), else the next ones of the samples `continued`
    (all of them `segment * plan.tokens` tokens long), resumed from their tokens so far."""
    generated = len(partial[continued[0]].token_ids) if partial else 0
    sampling = msgspec.structs.replace(request.sampling, max_tokens=plan.max_tokens(generated))
    if not partial:
        return msgspec.structs.replace(request, sampling=sampling)
    resume = tuple(partial[i].resumed(i) for i in continued)
    return msgspec.structs.replace(request, sampling=sampling, n=len(resume), resume=resume)
