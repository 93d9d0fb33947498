"""rlax_inference: the RLAX generation engine and the `rlax-worker` process.

Paged KV cache with reference-counted blocks (the n samples of a prompt share its blocks),
continuous batching with preemption by recomputation, seeded per-request sampling with
logprobs, weight hot-swap between steps, and a ZeroMQ worker that follows the parameter server.
"""

from rlax_inference.block_pool import NULL_BLOCK, BlockPool, BlockTable, KVCacheManager, NoFreeBlocksError
from rlax_inference.engine import CompletionOutput, EngineConfig, LLMEngine, RequestOutput, SwapPolicy
from rlax_inference.model_runner import ModelRunner
from rlax_inference.sampler import SamplerOutput, SamplingBatch, filtered_logits, row_key, sample
from rlax_inference.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from rlax_inference.sequence import FinishReason, SamplingParams
from rlax_inference.worker_process import Worker, WorkerConfig

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "BlockTable",
    "CompletionOutput",
    "EngineConfig",
    "FinishReason",
    "KVCacheManager",
    "LLMEngine",
    "ModelRunner",
    "NoFreeBlocksError",
    "RequestOutput",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SwapPolicy",
    "Worker",
    "WorkerConfig",
    "filtered_logits",
    "row_key",
    "sample",
]
