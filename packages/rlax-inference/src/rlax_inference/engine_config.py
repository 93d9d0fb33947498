"""`EngineConfig`: the sizes and modes of an `LLMEngine`, and how it swaps in new weights."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rlax_core.config import WorkersSection
from rlax_inference.model_runner import AttentionBackend
from rlax_inference.scheduler import SchedulerConfig

__all__ = ["EngineConfig", "FoldPrefill", "SwapPolicy"]


class SwapPolicy(enum.StrEnum):
    """What `LLMEngine.update_weights` does with samples that have started: `drop` restarts
    them under the new weights, `finish` lets them end under the old ones first."""

    DROP = "drop"
    FINISH = "finish"


class FoldPrefill(enum.StrEnum):
    """Whether a step's decode call also runs its prefill chunks (`EngineConfig.fold_prefill`):
    `on` (a new shape compiles on first use), `compiled` (only into mixed programs compiled
    before, `ModelRunner.compile_mixed`; otherwise decode and prefill run in calls of their
    own: a worker's setting, so that nothing compiles while it serves), `off`."""

    ON = "on"
    COMPILED = "compiled"
    OFF = "off"


# The engine options a run sets in its `workers:` section, by the same names: their defaults
# are defined there, once, and an engine made by hand starts from the same ones.
ENGINE_OPTIONS = ("max_num_seqs", "block_size", "max_num_batched_tokens", "attention", "num_decode_steps")
_RUN_DEFAULTS = WorkersSection()


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine. `num_blocks * block_size` tokens of KV fit in the cache.

    eos_token_ids: None means the model config's `eos_token_ids`.
    max_prefill_rows: prompts per prefill call (larger batches are split).
    attention: decode attention backend of `rlax_kernels.paged_attention` ("auto" = Pallas on
      TPU/GPU, the native `rlax_kernels.paged_attention_cpu` on CPU; or "cpu", "xla"
      (`rlax_kernels.paged_attention_xla`), "pallas_tpu", "pallas_gpu").
    attention_interpret: run a named Pallas kernel in interpret mode (tests on CPU).
    num_decode_steps: decode steps per model call when the pool has the blocks for them
      (multi-step decoding: each sampled token is fed back on the device, and the host
      schedules, transfers and checks stop conditions once per call). Outputs are the same
      as with single steps; a sequence that stops inside a call wastes the rest of it, and
      waiting requests join only between calls.
    watermark: fraction of the KV blocks that admission keeps free beyond what the next
      decode step needs (`SchedulerConfig.watermark`; `int(watermark * num_blocks)` blocks).
    enable_chunked_prefill: prefill prompts in chunks of at most `prefill_chunk_size` tokens
      (None: the step's token budget, `max_num_batched_tokens` minus the decode tokens), each
      chunk attending to the earlier ones through the paged cache; a step mixes decode
      tokens and prefill chunks. Off: a prompt is prefilled in one step, and
      `max_num_batched_tokens` must hold `max_model_len`.
    enable_prefix_caching: key full prompt blocks by their prefix's hash and let a new
      request start from the cached blocks of its longest cached prefix (computing only the
      rest); unreferenced cached blocks are evicted LRU when the pool runs short, and new
      weights drop every key.
    keep_stale_kv: on new weights, keep the cached K/V instead of dropping them, for requests
      that ask (`LLMEngine.add_request(..., reuse_stale_kv=True)`: resumed partial rollouts,
      PipelineRL's choice): such a request continues from the K/V of its tokens so far as the
      earlier weights computed them, and only its new tokens see the new weights. Every other
      request finds only the current weights' blocks. Needs `enable_prefix_caching`.
    seed: seeds the stream of seeds given to requests without one (`SamplingParams.seed=None`):
      distinct per request, and the same for the same engine seed and order of requests.
    aligned: compute as the trainer does under `trainer.batch_invariant`, so that a sampled
      token's float32 log-prob equals the trainer's recomputation to the bit (`ModelRunner`;
      decode attention then runs in XLA, not on the `attention` backend's kernel: slower).
    fold_prefill: `FoldPrefill` (on, compiled, off): a step that decodes and has prefill
      chunks to run takes up to `MIXED_PREFILL_ROWS` (4) of them, the shortest, into the
      decode call: one pass over the weights for both (vLLM's mixed batches), so a new
      request or a trajectory's next turn joins a running batch without a call of its own.
      Tokens are those of separate calls up to float32 rounding (greedy: the same). With
      multi-step decoding the chunks ride in the call's first step. Not when the new
      samples would more than double the decode rows' bucket, nor in the aligned mode
      (its shapes are the trainer's). Off by default: a mixed program compiles in about the
      time of a decode and a prefill program together, and on the 2-core CPU only steps
      where arrivals interleave with decoding gained (docs/benchmarks.md).
    """

    block_size: int = _RUN_DEFAULTS.block_size
    num_blocks: int = 1024
    max_num_seqs: int = _RUN_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _RUN_DEFAULTS.max_num_batched_tokens
    max_model_len: int = 1024
    max_prefill_rows: int = 16
    eos_token_ids: tuple[int, ...] | None = None
    swap_policy: SwapPolicy = SwapPolicy.DROP
    attention: AttentionBackend = _RUN_DEFAULTS.attention  # type: ignore[assignment]  # checked in __post_init__
    attention_interpret: bool = False
    num_decode_steps: int = _RUN_DEFAULTS.num_decode_steps
    watermark: float = 0.01
    enable_chunked_prefill: bool = True
    prefill_chunk_size: int | None = None
    enable_prefix_caching: bool = True
    keep_stale_kv: bool = False
    seed: int = 0
    aligned: bool = False
    fold_prefill: FoldPrefill = FoldPrefill.OFF

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_prefill_rows", "num_decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"EngineConfig.seed must be an int >= 0, got {self.seed!r}")
        if self.attention not in ("auto", "cpu", "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(
                f"EngineConfig.attention must be one of auto|cpu|xla|pallas_tpu|pallas_gpu, got {self.attention!r}"
            )
        if self.keep_stale_kv and not self.enable_prefix_caching:
            raise ValueError(
                "EngineConfig.keep_stale_kv needs enable_prefix_caching (the K/V kept are its blocks)"
            )
        object.__setattr__(self, "swap_policy", SwapPolicy(self.swap_policy))
        if self.fold_prefill not in tuple(FoldPrefill):
            raise ValueError(
                f"EngineConfig.fold_prefill must be one of on|compiled|off, got {self.fold_prefill!r}"
            )
        object.__setattr__(self, "fold_prefill", FoldPrefill(self.fold_prefill))
        self.scheduler_config()  # validates the scheduler limits

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            watermark=self.watermark,
            chunked_prefill=self.enable_chunked_prefill,
            prefill_chunk_size=self.prefill_chunk_size,
        )
