"""What `LLMEngine.update_weights` needs: new weights shaped as the loaded ones, and the
samples that started under the old weights, reset to be generated again under the new."""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np

from rlax_inference.block_pool import KVCacheManager
from rlax_inference.scheduler import PrefillJob, Scheduler
from rlax_inference.sequence import Request, SequenceStatus
from rlax_inference.sequence import Sequence as Seq
from rlax_model import Params

__all__ = ["check_same_structure", "restart_started", "started_sequences"]


def check_same_structure(old: Params, new: Params) -> None:
    """ValueError unless `new` has `old`'s tree structure and each leaf's shape and dtype."""
    old_leaves = jax.tree_util.tree_flatten_with_path(old)[0]
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
    # jaxlib's PyTreeDef is a C++ extension type without a stub: mypy cannot see its __ne__.
    if jax.tree_util.tree_structure(old) != new_def:  # type: ignore[operator]
        raise ValueError("update_weights: new params have a different tree structure than the loaded ones")
    for (path, a), (_, b) in zip(old_leaves, new_leaves, strict=True):
        if np.shape(a) != np.shape(b) or a.dtype != b.dtype:
            raise ValueError(
                f"update_weights: {jax.tree_util.keystr(path)} is {b.dtype}{list(np.shape(b))}, "
                f"expected {a.dtype}{list(np.shape(a))}"
            )


def started_sequences(requests: Iterable[Request], scheduler: Scheduler) -> list[Seq]:
    """Samples with tokens or K/V of the current weights: generating, or in the middle of a prefill."""
    prefilling = {id(s) for j in scheduler.prefilling for s in j.seqs}
    return [
        s
        for r in requests
        for s in r.sequences
        if s.status is not SequenceStatus.FINISHED and (s.num_generated > 0 or id(s) in prefilling)
    ]


def restart_started(requests: Iterable[Request], scheduler: Scheduler, kv: KVCacheManager) -> None:
    """Reset every request with a started sample to its prompt and queue it first.

    The whole request restarts (finished samples too), so all its samples come from one
    weight version.
    """
    sched = scheduler
    prefilling = {id(j.request) for j in sched.prefilling}
    restart = [r for r in requests if id(r) in prefilling or any(s.num_generated > 0 for s in r.sequences)]
    jobs = []
    for request in restart:
        for job in [j for j in sched.waiting if j.request is request]:
            sched.waiting.remove(job)
        for job in [j for j in sched.prefilling if j.request is request]:
            sched.drop_prefilling(job)
        for seq in request.sequences:
            if seq.table is not None:
                kv.free(seq.table)
                seq.table = None
            if seq in sched.running:
                sched.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            seq.finish_reason = None
            seq.stop_string = None
            del seq.tokens[seq.prompt_len :]
            seq.logprobs.clear()
            seq.top_logprobs.clear()
            seq.weight_version = None
        jobs.append(PrefillJob(request, list(request.sequences), list(request.prompt)))
    for job in sorted(jobs, key=lambda j: j.request.arrival, reverse=True):
        sched.waiting.appendleft(job)
