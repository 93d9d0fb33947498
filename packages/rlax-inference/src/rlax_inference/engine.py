"""`LLMEngine`: scheduler + block pool + model runner + sampler, one `step()` at a time.

```python
engine = LLMEngine(model_config, params, EngineConfig(num_blocks=512, max_model_len=512))
outs = engine.generate([[1, 5, 9], [1, 7]], SamplingParams(n=8, temperature=1.0, max_tokens=64, seed=3))
outs[0].outputs[5].tokens, outs[0].outputs[5].logprobs, outs[0].outputs[5].weight_version
```

Weight hot-swap (`update_weights`) happens between steps. Under the `drop` policy (the
paper's) every sample that has started generating is reset and regenerated from its prompt
under the new weights; under `finish` the swap waits until running samples have finished
under the old weights, and no new request starts meanwhile. Every output names the weight
version that produced all of its tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from rlax_core.config import WorkersSection
from rlax_inference.block_pool import KVCacheManager
from rlax_inference.model_runner import AttentionBackend, ModelRunner, PrefillChunk
from rlax_inference.scheduler import PrefillJob, Scheduler, SchedulerConfig
from rlax_inference.sequence import FinishReason, Request, SamplingParams, SequenceStatus
from rlax_inference.sequence import Sequence as Seq
from rlax_model import ModelConfig, Params

log = logging.getLogger(__name__)


class SwapPolicy(enum.StrEnum):
    DROP = "drop"
    FINISH = "finish"


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
    seed: seeds the stream of seeds given to requests without one (`SamplingParams.seed=None`):
      distinct per request, and the same for the same engine seed and order of requests.
    aligned: compute as the trainer does under `trainer.batch_invariant`, so that a sampled
      token's float32 log-prob equals the trainer's recomputation to the bit (`ModelRunner`;
      decode attention then runs in XLA, not on the `attention` backend's kernel: slower).
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
    seed: int = 0
    aligned: bool = False

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
        object.__setattr__(self, "swap_policy", SwapPolicy(self.swap_policy))
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


@dataclass
class CompletionOutput:
    """One sample of a request. logprobs: [len(tokens)]; top_logprobs: per token, (id, logprob) pairs."""

    sample_index: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_string: str | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """All samples of one request, and the error that kept it from running or ended it (None if none).

    A request that failed inside a step keeps what its samples generated before the failure,
    with finish reason ABORT.
    """

    request_id: str
    prompt: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None

    @property
    def weight_version(self) -> int | None:
        """The one weight version behind every sample (None if nothing was generated)."""
        versions = {c.weight_version for c in self.outputs if c.weight_version is not None}
        if len(versions) > 1:
            raise AssertionError(f"request {self.request_id} mixes weight versions {sorted(versions)}")
        return versions.pop() if versions else None


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        params: Params,
        config: EngineConfig | None = None,
        *,
        weight_version: int = 0,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = config = config or EngineConfig()
        if config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_config.max_position_embeddings}"
            )
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config(), self.kv)
        self.runner = ModelRunner(
            model_config,
            params,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_prefill_rows=config.max_prefill_rows,
            attention=config.attention,
            interpret=config.attention_interpret,
            aligned=config.aligned,
        )
        self.weight_version = weight_version
        self.detokenize = detokenize
        eos = config.eos_token_ids if config.eos_token_ids is not None else model_config.eos_token_ids
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Request] = {}
        self._arrival = itertools.count()
        self._pending_weights: tuple[Params, int] | None = None
        self._finished: list[RequestOutput] = []
        # Seeds of unseeded requests: seed_k = (a * k + b) mod 2**32 for the k-th one, with a odd
        # (a bijection of k, so no two collide) and a, b drawn from the engine's seed.
        a, b = np.random.default_rng(config.seed).integers(2**32, size=2, dtype=np.uint64).tolist()
        self._seed_stream = (a | 1, b)
        self._num_drawn_seeds = 0
        self.num_steps = 0
        self.num_generated_tokens = 0

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError naming the field (engine state untouched) when it cannot run.

        `SamplingParams` checks the rules that hold for any model; this checks those of this
        model and engine (vocabulary, context length, pool and batch sizes), so nothing that
        would fail inside `step()` is ever scheduled. A request without a seed gets the next
        one of the engine's stream (`EngineConfig.seed`).
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            tokens = self._check_request(prompt, params)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._next_seed())
        request = Request(request_id, tokens, params, next(self._arrival))
        self.scheduler.add(request)
        self._requests[request_id] = request

    def _check_request(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as ints; ValueError for what this model or engine cannot run."""
        tokens = []
        for i, t in enumerate(prompt):
            try:
                tokens.append(operator.index(t))
            except TypeError:
                raise ValueError(f"prompt token {t!r} at index {i} is not an int") from None
        vocab = self.model_config.vocab_size
        bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab]
        if bad:
            i, t = bad[0]
            raise ValueError(f"prompt token {t} at index {i} is outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "top_k"):
            value = getattr(params, name)
            if value > vocab:
                raise ValueError(f"SamplingParams.{name}={value} exceeds the vocabulary size {vocab}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(
                f"SamplingParams.stop_token_ids={params.stop_token_ids} holds token {bad_stop[0]} "
                f"outside the vocabulary [0, {vocab})"
            )
        if params.stop and self.detokenize is None:
            raise ValueError("stop strings need an engine built with detokenize=")
        self.scheduler.check_fits(len(tokens), params.n, params.max_tokens)
        return tokens

    def _next_seed(self) -> int:
        a, b = self._seed_stream
        seed = (a * self._num_drawn_seeds + b) % 2**32
        self._num_drawn_seeds += 1
        return seed

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its output (aborted samples have reason ABORT)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request_id)
        return self._output(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- weights --------------------------------------------------------------------
    def update_weights(self, params: Params, version: int, *, policy: SwapPolicy | str | None = None) -> None:
        """Swap in new weights between steps (see the module docstring for the policies)."""
        _check_same_structure(self.runner.params, params)
        policy = SwapPolicy(policy or self.config.swap_policy)
        if policy is SwapPolicy.FINISH and self._started_sequences():
            self._pending_weights = (params, version)
            return
        if policy is SwapPolicy.DROP:
            self._restart_started()
        self._apply_weights(params, version)

    def _apply_weights(self, params: Params, version: int) -> None:
        # Cached K/V were computed by the old weights: no new request may start from them.
        self.kv.pool.reset_prefix_cache()
        self.runner.params = params
        self.weight_version = version
        self._pending_weights = None

    def _started_sequences(self) -> list[Seq]:
        """Samples with tokens or K/V of the current weights: generating, or in the middle of a prefill."""
        prefilling = {id(s) for j in self.scheduler.prefilling for s in j.seqs}
        return [
            s
            for r in self._requests.values()
            for s in r.sequences
            if s.status is not SequenceStatus.FINISHED and (s.num_generated > 0 or id(s) in prefilling)
        ]

    def _restart_started(self) -> None:
        """Reset every request with a started sample to its prompt and queue it first.

        The whole request restarts (finished samples too), so all its samples come from one
        weight version.
        """
        sched = self.scheduler
        prefilling = {id(j.request) for j in sched.prefilling}
        restart = [
            r
            for r in self._requests.values()
            if id(r) in prefilling or any(s.num_generated > 0 for s in r.sequences)
        ]
        jobs = []
        for request in restart:
            for job in [j for j in sched.waiting if j.request is request]:
                sched.waiting.remove(job)
            for job in [j for j in sched.prefilling if j.request is request]:
                sched.drop_prefilling(job)
            for seq in request.sequences:
                if seq.table is not None:
                    self.kv.free(seq.table)
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

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that finished in it.

        An exception from the model or from handling a request's tokens ends the requests it
        touched (a model call: every request in it; a token: its request) with `error` set and
        their blocks freed, logs it with its traceback, and the step goes on with the others.
        """
        if self._pending_weights is not None and not self._started_sequences():
            self._apply_weights(*self._pending_weights)
        sched = self.scheduler
        out = sched.schedule(admit_new=self._pending_weights is None, num_steps=self.config.num_decode_steps)
        num_top = max(
            [s.request.params.logprobs for s in out.decodes]
            + [j.request.params.logprobs for j in out.prefills]
            + [0]
        )
        if out.decodes:
            self._run_decodes(out.decodes, out.decode_slots, out.copies, num_top)
        # Similar lengths together waste less padding; a call holds at most max_prefill_rows chunks.
        jobs = sorted(out.prefills, key=lambda j: j.chunk_end - j.chunk_start)
        rows = self.config.max_prefill_rows
        for group in (jobs[i : i + rows] for i in range(0, len(jobs), rows)):
            # A request that failed earlier in this step no longer holds its jobs' blocks.
            group = [j for j in group if self._is_live(j.request)]
            if group:
                self._run_prefills(group, num_top)
        self.num_steps += 1
        finished, self._finished = self._finished, []
        return finished

    def _run_decodes(
        self, seqs: list[Seq], slots: list[list[int]], copies: list[tuple[int, int]], num_top: int
    ) -> None:
        """One decode call for the running samples (`slots`: the slots each feeds) and its tokens."""
        try:
            self.runner.copy_blocks(copies)
            # One program per configured step count: a call near the end runs a few idle steps.
            multi = max(len(s) for s in slots) > 1
            res = self.runner.decode(
                [s.tokens[-1] for s in seqs],
                slots,
                [s.table.blocks for s in seqs],  # type: ignore[union-attr]
                [len(s.tokens) for s in seqs],
                [_sampling_row(s) for s in seqs],
                num_steps=self.config.num_decode_steps if multi else 1,
                num_top=num_top,
            )
        except Exception as error:
            self._fail([s.request for s in seqs], error)
            return
        tokens, logprobs = res.tokens.T.tolist(), res.logprobs.T.tolist()  # [n][num_steps]
        for i, (seq, seq_slots) in enumerate(zip(seqs, slots, strict=True)):
            if seq.status is SequenceStatus.FINISHED:
                continue  # its request failed on an earlier sample's token
            made = len(seq_slots)
            try:
                if seq.request.params.stop or seq.request.params.logprobs:
                    for j in range(made):
                        self._append_token(
                            seq, tokens[i][j], logprobs[i][j], res.top_ids[j, i], res.top_logprobs[j, i]
                        )
                        if seq.status is SequenceStatus.FINISHED:
                            break  # stopped inside a multi-step call: its later tokens are dropped
                else:
                    self._append_plain_tokens(seq, tokens[i][:made], logprobs[i][:made])
            except Exception as error:
                self._fail([seq.request], error)

    def _run_prefills(self, group: list[PrefillJob], num_top: int) -> None:
        """One prefill call for `group`'s chunks; the jobs whose prompt it completes start sampling."""
        # Only a job's last chunk samples (from its last token's logits); row i of the result is seqs[i].
        seqs = [s for j in group if j.is_last_chunk for s in j.seqs]
        samples = [(i, _sampling_row(s)) for i, j in enumerate(group) if j.is_last_chunk for s in j.seqs]
        try:
            res = self.runner.prefill_chunks([self._chunk(j) for j in group], samples, num_top=num_top)
        except Exception as error:
            self._fail([j.request for j in group], error)
            return
        for job in group:
            try:
                self.scheduler.finish_chunk(job)
            except Exception as error:
                self._fail([job.request], error)
        tokens, logprobs = res.tokens.tolist(), res.logprobs.tolist()
        for i, seq in enumerate(seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # its request failed above
            try:
                self._append_token(seq, tokens[i], logprobs[i], res.top_ids[i], res.top_logprobs[i])
            except Exception as error:
                self._fail([seq.request], error)

    def _is_live(self, request: Request) -> bool:
        return self._requests.get(request.request_id) is request

    def _fail(self, requests: Iterable[Request], error: Exception) -> None:
        """End `requests` after `error` in a step: abort their samples, free their blocks and
        report each with `error` set (from the next `step()` return)."""
        live = [r for r in dict.fromkeys(requests) if self._is_live(r)]
        if not live:
            return
        ids = [r.request_id for r in live]
        log.error("step %d failed for requests %s; aborting them", self.num_steps, ids, exc_info=error)
        for request in live:
            self.scheduler.abort(request.request_id)
            del self._requests[request.request_id]
            output = self._output(request)
            output.error = f"engine step failed: {type(error).__name__}: {error}"
            self._finished.append(output)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; bad requests get `error` set, the others run normally."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        results: dict[str, RequestOutput] = {}
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            request_id = f"gen-{next(self._arrival)}"
            ids.append(request_id)
            try:
                self.add_request(request_id, prompt, p)
            except (ValueError, TypeError) as e:
                results[request_id] = RequestOutput(request_id, list(prompt), error=str(e))
        while any(i not in results for i in ids):
            for out in self.step():
                results[out.request_id] = out
        return [results[i] for i in ids]

    # -- internals ------------------------------------------------------------------
    def _chunk(self, job: PrefillJob) -> PrefillChunk:
        """This step's chunk of `job`: its tokens, the slots their K/V go to, and the block table
        through which they read the job's earlier tokens (computed, shared or prefix-cached)."""
        bs = self.config.block_size
        blocks = job.table.blocks  # type: ignore[union-attr]
        slots = [blocks[i // bs] * bs + i % bs for i in range(job.chunk_start, job.chunk_end)]
        return PrefillChunk(job.chunk, job.chunk_start, slots, blocks)

    def _append_token(
        self, seq: Seq, token: int, logprob: float, top_ids: np.ndarray, top_lps: np.ndarray
    ) -> None:
        """Record one sampled token (top_ids/top_lps: [num_top]) and finish the sample if it stops here."""
        if seq.weight_version is None:
            seq.weight_version = self.weight_version
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        n_top = seq.request.params.logprobs
        if n_top:
            seq.top_logprobs.append(list(zip(top_ids[:n_top].tolist(), top_lps[:n_top].tolist())))
        self.num_generated_tokens += 1
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)

    def _append_plain_tokens(self, seq: Seq, tokens: list[int], logprobs: list[float]) -> None:
        """`_append_token` over the tokens one call made for a sample without stop strings or top
        logprobs: the same stops (EOS and stop tokens first, then the length limits), in bulk."""
        p = seq.request.params
        if seq.weight_version is None:
            seq.weight_version = self.weight_version
        limit = min(p.max_tokens - seq.num_generated, self.config.max_model_len - len(seq.tokens))
        count, reason = min(len(tokens), limit), None
        for j in range(count):
            if self._is_stop_token(p, tokens[j]):
                count, reason = j + 1, FinishReason.EOS
                break
        if reason is None and count == limit:
            reason = FinishReason.LENGTH
        seq.tokens.extend(tokens[:count])
        seq.logprobs.extend(logprobs[:count])
        self.num_generated_tokens += count
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Seq, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        if seq.request.finished and seq.request.request_id in self._requests:
            del self._requests[seq.request.request_id]
            self._finished.append(self._output(seq.request))

    def _is_stop_token(self, p: SamplingParams, token: int) -> bool:
        """EOS (unless the request ignores it) or one of the request's stop tokens."""
        return (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids

    def _stop_reason(self, seq: Seq) -> FinishReason | None:
        p = seq.request.params
        token = seq.tokens[-1]
        if self._is_stop_token(p, token):
            return FinishReason.EOS
        if p.stop:
            text = self.detokenize(seq.output_tokens)  # type: ignore[misc]
            for s in p.stop:
                if s in text:
                    seq.stop_string = s
                    return FinishReason.STOP
        if seq.num_generated >= p.max_tokens or len(seq.tokens) >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _output(request: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                s.sample_index,
                s.output_tokens,
                list(s.logprobs),
                s.finish_reason or FinishReason.ABORT,
                s.weight_version,
                list(s.top_logprobs),
                s.stop_string,
                s.num_preemptions,
            )
            for s in request.sequences
        ]
        return RequestOutput(request.request_id, list(request.prompt), outs)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free

    # -- counters a worker can report ---------------------------------------------------
    @property
    def num_prefix_cache_hit_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache instead of being computed."""
        return self.scheduler.num_prefix_cache_hit_tokens

    @property
    def num_computed_prefill_tokens(self) -> int:
        """Prompt (and recomputed) tokens the prefill computed."""
        return self.scheduler.num_computed_prefill_tokens

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix-cache and prefill counters since the engine started."""
        pool = self.kv.pool
        return {
            "prefix_cache_hit_tokens": self.scheduler.num_prefix_cache_hit_tokens,
            "prefix_cache_hit_blocks": self.scheduler.num_prefix_cache_hit_blocks,
            "computed_prefill_tokens": self.scheduler.num_computed_prefill_tokens,
            "cached_blocks": pool.num_cached,
            "evicted_blocks": pool.num_evictions,
        }


def _sampling_row(seq: Seq) -> tuple[float, float, int, int, int, int]:
    p = seq.request.params
    return (float(p.temperature), float(p.top_p), p.top_k, p.seed, seq.sample_index, seq.num_generated)


def _check_same_structure(old: Params, new: Params) -> None:
    old_leaves = jax.tree_util.tree_flatten_with_path(old)[0]
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
    if jax.tree_util.tree_structure(old) != new_def:
        raise ValueError("update_weights: new params have a different tree structure than the loaded ones")
    for (path, a), (_, b) in zip(old_leaves, new_leaves, strict=True):
        if np.shape(a) != np.shape(b) or a.dtype != b.dtype:
            raise ValueError(
                f"update_weights: {jax.tree_util.keystr(path)} is {b.dtype}{list(np.shape(b))}, "
                f"expected {a.dtype}{list(np.shape(a))}"
            )
