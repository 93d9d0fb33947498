"""Requests, their sampling parameters, and the per-sample sequences the engine runs."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from rlax_inference.block_pool import ROOT_KEY, BlockTable


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one request.

    `temperature == 0` is greedy decoding. `top_k == 0` and `top_p == 1` switch those
    filters off. `n` completions (the group size G) share the prompt's KV blocks.
    `seed` fixes sample `i`'s token at step `t` to a key derived from (seed, i, t) only,
    so the output does not depend on what else is in the batch. `seed=None` lets the engine
    draw one (distinct per request, reproducible from `EngineConfig.seed` and the order of
    `add_request` calls).
    `logprobs` asks for that many top logprobs per generated token (0 = none).
    `sample_offset` / `step_offset` shift (i, t) in that key: a request that continues
    sample 5 of an earlier request after its first 40 tokens (a partial rollout resumed,
    `rlax_protocol.ResumedSample`) sets 5 and 40 and draws the keys the uninterrupted
    sample would have drawn.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    sample_offset: int = 0
    step_offset: int = 0

    def __post_init__(self) -> None:
        """The rules that hold whatever the model; the engine checks the rest (vocabulary, lengths)."""
        _require(_is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        _require(
            _is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            self.temperature,
            "a finite number >= 0",
        )
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an int >= 0")
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an int >= 1"
        )
        _require(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**32),
            "seed",
            self.seed,
            "None or an int in [0, 2**32)",
        )
        _require(_is_int(self.logprobs) and self.logprobs >= 0, "logprobs", self.logprobs, "an int >= 0")
        _require(
            isinstance(self.stop_token_ids, tuple)
            and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a tuple of ints >= 0",
        )
        _require(
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "a tuple of non-empty strings",
        )
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        for name in ("sample_offset", "step_offset"):
            value = getattr(self, name)
            _require(_is_int(value) and 0 <= value < 2**31, name, value, "an int in [0, 2**31)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _require(ok: bool, name: str, value: object, what: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {what}, got {value!r}")


class FinishReason(enum.StrEnum):
    EOS = "eos"  # an end-of-sequence or stop token id was generated
    STOP = "stop"  # a stop string appeared in the detokenized output
    LENGTH = "length"  # max_tokens or the context length was reached
    ABORT = "abort"  # the caller aborted the request

    @property
    def wire(self) -> str:
        """The `rlax_protocol.Sample.finish_reason` it is sent as (a stop token or string: "stop")."""
        return "stop" if self in (FinishReason.EOS, FinishReason.STOP) else self.value


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One prompt and its `params.n` samples."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int
    sequences: list[Sequence] = field(default_factory=list)
    # Prompt tokens found in the prefix cache when it was first admitted (None: not yet admitted).
    num_cached_tokens: int | None = None
    # May start from K/V that earlier weights computed (a resumed partial rollout under
    # `EngineConfig.keep_stale_kv`).
    reuse_stale_kv: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.sequences)


@dataclass(eq=False)
class Sequence:
    """One sample of a request: its tokens so far, their logprobs and its KV blocks."""

    seq_id: int
    request: Request
    sample_index: int
    tokens: list[int]
    prompt_len: int
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    table: BlockTable | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    # Weight version of the first generated token; all tokens share it (swaps restart).
    weight_version: int | None = None
    num_preemptions: int = 0
    # The prefix cache's key chain its blocks belong to (`KVCacheManager.root` when it started,
    # or the earlier weights' chain its K/V continue).
    cache_root: int = ROOT_KEY

    @property
    def kv_table(self) -> BlockTable:
        """`table` of a sample that holds KV blocks (running, or handed a prefill's table)."""
        assert self.table is not None, f"sequence {self.seq_id} holds no KV blocks"
        return self.table

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len
