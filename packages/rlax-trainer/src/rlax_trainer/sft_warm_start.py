"""The SFT warm start: cross-entropy on a task's reference answers before RL begins."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.sharding import Mesh

import rlax_model
from rlax_protocol import Rollout
from rlax_trainer.buffer import collate
from rlax_trainer.config import LearnerConfig
from rlax_trainer.learner import Learner

__all__ = ["sft_warm_start"]

log = logging.getLogger("rlax.trainer")


def sft_warm_start(
    task: Any,
    model_config: rlax_model.ModelConfig,
    sft_config: LearnerConfig,
    params: Any,
    *,
    steps: int,
    data_seed: int,
    seed: int,
    mesh: Mesh | None,
    pad_id: int,
    seq_len: int,
    log_metrics: Callable[[dict[str, Any]], None],
) -> Any:
    """`steps` updates of `sft_config` (SFT mode, `global_batch` examples each) on the task's
    reference answers, in a deterministic order from `data_seed`; -> the policy's params on
    this host. Every process of a trainer gang runs it (the final gather is a collective);
    `log_metrics` gets the summary record."""
    learner = Learner(model_config, sft_config, params, mesh=mesh, seed=seed)
    records = task.train_records()
    order = np.random.default_rng(data_seed + 17).permutation(len(records))
    batch_size = sft_config.global_batch
    started = time.monotonic()
    for step in range(steps):
        picked = [records[int(order[(step * batch_size + i) % len(records)])] for i in range(batch_size)]
        groups = []
        for record in picked:
            target, model_mask = task.sft_example(record)
            groups.append(
                [
                    Rollout(
                        prompt_id=record.id,
                        group_index=0,
                        prompt_token_ids=tuple(task.encode_prompt(record)),
                        completion_token_ids=tuple(target),
                        worker_logprobs=(0.0,) * len(target),
                        policy_version=0,
                        reward=0.0,
                        completion_mask=tuple(model_mask),
                    )
                ]
            )
        metrics = learner.update(collate(groups, pad_id=pad_id, seq_len=seq_len))
        if step % 10 == 0 or step == steps - 1:
            log.info("SFT step %d/%d: %s", step + 1, steps, {k: round(v, 4) for k, v in metrics.items()})
    log_metrics({"kind": "sft", "steps": steps, "seconds": time.monotonic() - started, **metrics})
    return learner.host_params()["policy"]  # a gather across the gang: every process calls it
