"""The shapes a worker compiles at its first weights (`WarmUp`), so that generation runs at
the engine's warm speed from the first request on."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlax_core.config import RunConfig
from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.engine_config import FoldPrefill
from rlax_inference.sequence import SamplingParams

__all__ = ["WarmUp", "compile_all_shapes", "compile_run_shapes"]

log = logging.getLogger("rlax.worker")


@dataclass(frozen=True)
class WarmUp:
    """The shapes to compile at the first weights: decode for up to `rows` rows at every
    block-table width and each of `decode_steps`; prefill of `sampling.n` samples of dummy
    prompts of `prompt_lengths` tokens (one token each), and of `prompt_counts` prompts
    prefilled together (groups that arrive at once share one prefill call, whose row
    buckets would otherwise compile in the middle of the run)."""

    rows: int
    decode_steps: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    sampling: SamplingParams
    prompt_counts: tuple[int, ...] = ()
    # Mixed steps (`EngineConfig.fold_prefill`) with chunks of up to this many tokens; 0: none
    # (a run whose groups never arrive while others decode).
    mixed_chunk_tokens: int = 0

    @classmethod
    def for_run(cls, config: RunConfig, task: Any) -> WarmUp:
        """One group's rows (up to the worker's in-flight groups), the shortest and the
        longest of the task's first prompts."""
        data, workers = config.data, config.workers
        try:
            lengths = sorted({len(task.encode_prompt(r)) for r in task.train_records()[:64]})
        except Exception as error:  # the prompts are not readable here: prefill compiles on first use
            log.warning("prefill warm-up skipped: cannot read the task's prompts (%s)", error)
            lengths = []
        room = config.model.max_seq_len - 1
        # Row buckets are powers of two: 2, 4, 8, ... prompts up to the groups a worker can
        # hold at once reach every prefill shape of the run.
        together = min(workers.max_inflight_groups, max(1, workers.max_num_seqs // data.group_size))
        counts = {min(2**i, together) for i in range(1, together.bit_length() + 1)} if together > 1 else set()
        return cls(
            mixed_chunk_tokens=_mixed_chunk_tokens(config, lengths[-1:]),
            prompt_counts=tuple(sorted(counts)),
            rows=min(workers.max_num_seqs, data.group_size * max(1, workers.max_inflight_groups)),
            decode_steps=tuple(sorted({1, workers.num_decode_steps})),
            prompt_lengths=tuple(sorted({max(1, min(n, room)) for n in (lengths[:1] + lengths[-1:])})),
            sampling=SamplingParams(
                n=min(data.group_size, workers.max_num_seqs),
                temperature=data.temperature,
                top_p=data.top_p,
                top_k=data.top_k,
                max_tokens=1,
            ),
        )


def compile_run_shapes(engine: LLMEngine, plan: WarmUp) -> float:
    """Compile the shapes of `plan` on `engine`; -> the seconds it took.

    Decode: padding rows only (the cache is not written); prefill: a one-token request on a
    dummy prompt of each length (its blocks go back to the pool).
    """
    started = time.monotonic()
    row_count = min(8, plan.rows)
    while True:
        engine.runner.warmup(row_count, plan.decode_steps)
        if row_count >= plan.rows:
            break
        row_count = min(plan.rows, row_count * 2)
    if engine.config.fold_prefill is not FoldPrefill.OFF and plan.mixed_chunk_tokens:
        sampling = plan.sampling
        row = (float(sampling.temperature), float(sampling.top_p), sampling.top_k, 0, 0, 0)
        engine.runner.compile_mixed(plan.rows, plan.mixed_chunk_tokens, [row], 0, plan.decode_steps)
    for length in plan.prompt_lengths:
        engine.generate([[0] * length], plan.sampling)
    if plan.prompt_lengths:
        vocab, length = engine.runner.config.vocab_size, plan.prompt_lengths[-1]
        for count in plan.prompt_counts:
            # Distinct first tokens: no prompt shares another's prefix (or its cache).
            engine.generate([[i % vocab] + [0] * (length - 1) for i in range(count)], plan.sampling)
    return time.monotonic() - started


def compile_all_shapes(engine: LLMEngine, sampling: Sequence[SamplingParams] = (SamplingParams(),)) -> float:
    """Compile every program `engine` can call for requests sampled like `sampling`; -> seconds.

    The shapes are bounded by the engine's config: decode rows up to `max_num_seqs`, every
    block-table width, one and `num_decode_steps` steps; prefill chunks up to the step's
    token budget (or `prefill_chunk_size`), every prefill row bucket; sampling of every
    sample-row bucket; every block-copy bucket; and with `fold_prefill: on` the mixed steps
    (`ModelRunner.compile_mixed`: decode row pairs x chunk lengths x step counts, each about a
    decode and a prefill program's compile time). After it, preemption, copy-on-write,
    prefix hits, chunked prefill and mixed steps run without compiling (`test_engine_compilation`).
    """
    started = time.monotonic()
    config = engine.config
    engine.runner.compile_shapes(
        max_chunk_tokens=longest_chunk(config),
        decode_rows=config.max_num_seqs,
        decode_steps=sorted({1, config.num_decode_steps}),
        sampling=[(float(p.temperature), float(p.top_p), p.top_k, 0, 0, 0) for p in sampling],
        num_top=max(p.logprobs for p in sampling),
        # Under `compiled` the engine folds only into mixed programs someone compiled on purpose.
        mixed=config.fold_prefill is FoldPrefill.ON,
    )
    return time.monotonic() - started


def longest_chunk(config: EngineConfig) -> int:
    """The longest prefill chunk `config` schedules: the step's token budget (or the chunk
    size) with chunked prefill, a whole context without."""
    if not config.enable_chunked_prefill:
        return config.max_model_len
    return min(config.prefill_chunk_size or config.max_num_batched_tokens, config.max_num_batched_tokens)


def _mixed_chunk_tokens(config: RunConfig, longest_prompt: list[int]) -> int:
    """The longest chunk the run's warm-up compiles mixed steps for: 0 without
    `workers.fold_prefill` or when no group arrives while others decode (synchronous steps
    whose groups a worker takes at once, single turn). A multi-turn run's next turns are short (an observation and the previous turn's
    last token): one length bucket (a longer one, a prefix-cache miss, runs in calls of its
    own); a group's prompt: the longest of the task's first prompts (or the context)."""
    workers = config.workers
    if not workers.fold_prefill:
        return 0
    groups_per_worker = -(-config.data.prompts_per_step // workers.count)
    multi_turn = bool(config.agent.environment)
    overlaps = multi_turn or config.pinned_lag > 0 or config.controller.versions == "freshest"
    if not (overlaps or workers.max_inflight_groups < groups_per_worker):
        return 0
    room = config.model.max_seq_len
    if multi_turn:
        return min(SHORT_CHUNK_TOKENS, room)
    return min(longest_prompt[0] if longest_prompt else room, workers.max_num_batched_tokens, room)


# A multi-turn run's mixed steps are compiled for chunks up to this many tokens.
SHORT_CHUNK_TOKENS = 16
