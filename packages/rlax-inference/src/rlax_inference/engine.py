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
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from rlax_inference.block_pool import KVCacheManager
from rlax_inference.engine_config import EngineConfig, FoldPrefill, SwapPolicy
from rlax_inference.engine_outputs import CompletionOutput, RequestOutput, request_output
from rlax_inference.model_runner import MIXED_PREFILL_ROWS, ModelRunner, PrefillChunk, StepResult
from rlax_inference.request_rules import SeedStream, checked_prompt, plain_tokens_stop, stop_reason
from rlax_inference.scheduler import PrefillJob, Scheduler
from rlax_inference.sequence import FinishReason, Request, SamplingParams, SequenceStatus
from rlax_inference.sequence import Sequence as Seq
from rlax_inference.weight_swap import check_same_structure, restart_started, started_sequences
from rlax_model import ModelConfig, Params

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SwapPolicy"]

log = logging.getLogger(__name__)


class LLMEngine:
    """Generation over a paged KV cache: `add_request` queues, `step()` runs one scheduling
    step and returns the requests it finished, `generate` runs prompts to completion."""

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
        self._seeds = SeedStream(config.seed)  # for requests without a seed
        self.num_steps = 0
        self.num_generated_tokens = 0
        # Model calls by kind: decode, prefill, and decode calls that also ran prefill chunks
        # (`fold_prefill`); a call that failed counts too.
        self.num_decode_calls = self.num_prefill_calls = self.num_mixed_calls = 0

    # -- requests -------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams, *, reuse_stale_kv: bool = False
    ) -> None:
        """Queue a request; raises ValueError naming the field (engine state untouched) when it cannot run.

        `reuse_stale_kv`: the request may start from K/V that earlier weights computed for its
        prompt (a resumed partial rollout; only under `EngineConfig.keep_stale_kv`).

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
            vocab_size, can_detokenize = self.model_config.vocab_size, self.detokenize is not None
            tokens = checked_prompt(prompt, params, vocab_size=vocab_size, can_detokenize=can_detokenize)
            self.scheduler.check_fits(len(tokens), params.n, params.max_tokens)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seeds.next())
        request = Request(
            request_id,
            tokens,
            params,
            next(self._arrival),
            reuse_stale_kv=reuse_stale_kv and self.config.keep_stale_kv,
        )
        self.scheduler.add(request)
        self._requests[request_id] = request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its output (aborted samples have reason ABORT)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort(request_id)
        return request_output(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- weights --------------------------------------------------------------------
    def update_weights(self, params: Params, version: int, *, policy: SwapPolicy | str | None = None) -> None:
        """Swap in new weights between steps (see the module docstring for the policies)."""
        check_same_structure(self.runner.params, params)
        policy = SwapPolicy(policy or self.config.swap_policy)
        if policy is SwapPolicy.FINISH and started_sequences(self._requests.values(), self.scheduler):
            self._pending_weights = (params, version)
            return
        if policy is SwapPolicy.DROP:
            restart_started(self._requests.values(), self.scheduler, self.kv)
        self._apply_weights(params, version)

    def _apply_weights(self, params: Params, version: int) -> None:
        # Cached K/V were computed by the old weights: no new request may start from them
        # (with `keep_stale_kv`, only a request that asks for them: a resumed partial rollout).
        self.kv.new_weights(keep=self.config.keep_stale_kv)
        self.runner.params = params
        self.weight_version = version
        self._pending_weights = None

    # -- stepping -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that finished in it.

        An exception from the model or from handling a request's tokens ends the requests it
        touched (a model call: every request in it; a token: its request) with `error` set and
        their blocks freed, logs it with its traceback, and the step goes on with the others.
        """
        if self._pending_weights is not None and not started_sequences(
            self._requests.values(), self.scheduler
        ):
            self._apply_weights(*self._pending_weights)
        sched = self.scheduler
        out = sched.schedule(admit_new=self._pending_weights is None, num_steps=self.config.num_decode_steps)
        num_top = max(
            [s.request.params.logprobs for s in out.decodes]
            + [j.request.params.logprobs for j in out.prefills]
            + [0]
        )
        # Every copy-on-write of the step (decode tails, and partial blocks that new prefills took
        # from the prefix cache) runs first, in one call: a copy's source may be handed out again
        # in this very step, and it is only written after this.
        if out.copies and not self._run_copies(out.copies, out.decodes, out.prefills):
            out.decodes, out.decode_slots = [], []
            out.prefills = [j for j in out.prefills if self._is_live(j.request)]
        # Similar lengths together waste less padding; a call holds at most max_prefill_rows chunks.
        jobs = sorted(out.prefills, key=lambda j: j.chunk_end - j.chunk_start)
        if (
            out.decodes
            and jobs
            and self._folds_prefill(out.decodes, out.decode_slots, jobs[:MIXED_PREFILL_ROWS], num_top)
        ):
            # The shortest chunks ride along with the decode step (one pass over the weights).
            folded, jobs = jobs[:MIXED_PREFILL_ROWS], jobs[MIXED_PREFILL_ROWS:]
            self._run_mixed(out.decodes, out.decode_slots, folded, num_top)
        elif out.decodes:
            self._run_decodes(out.decodes, out.decode_slots, num_top)
        rows = self.config.max_prefill_rows
        for group in (jobs[i : i + rows] for i in range(0, len(jobs), rows)):
            # A request that failed earlier in this step no longer holds its jobs' blocks.
            group = [j for j in group if self._is_live(j.request)]
            if group:
                self._run_prefills(group, num_top)
        self.num_steps += 1
        finished, self._finished = self._finished, []
        return finished

    def _run_copies(self, copies: list[tuple[int, int]], seqs: list[Seq], jobs: list[PrefillJob]) -> bool:
        """Run the step's block copies; on failure end every request of the step (False)."""
        try:
            self.runner.copy_blocks(copies)
        except Exception as error:
            self._fail([s.request for s in seqs] + [j.request for j in jobs], error)
            return False
        return True

    def _folds_prefill(
        self, seqs: list[Seq], slots: list[list[int]], group: list[PrefillJob], num_top: int
    ) -> bool:
        """Whether this step's decode call also takes `group`'s chunks (`EngineConfig.fold_prefill`;
        the aligned mode keeps the trainer's separate shapes). Under `compiled`, only into a
        program compiled before (else both parts run in calls of their own)."""
        if self.config.fold_prefill is FoldPrefill.OFF or self.config.aligned:
            return False
        sampling = [_sampling_row(s) for j in group if j.is_last_chunk for s in j.seqs]
        steps = self.config.num_decode_steps if max(len(s) for s in slots) > 1 else 1
        chunks = [prefill_chunk(j, self.config.block_size) for j in group]
        rows = [*map(_sampling_row, seqs), *sampling]
        key = self.runner.mixed_program(len(seqs), len(sampling), chunks, steps, num_top, rows)
        if key is None:
            return False
        return self.config.fold_prefill is FoldPrefill.ON or key in self.runner.mixed_programs

    def _run_mixed(
        self, seqs: list[Seq], slots: list[list[int]], group: list[PrefillJob], num_top: int
    ) -> None:
        """One call: the decode steps of the running samples, with a chunk of each of `group`'s
        jobs in the first."""
        sampled = [s for j in group if j.is_last_chunk for s in j.seqs]
        samples = [(i, _sampling_row(s)) for i, j in enumerate(group) if j.is_last_chunk for s in j.seqs]
        self.num_mixed_calls += 1
        try:
            decoded, prefilled = self.runner.decode_with_prefill(
                [s.tokens[-1] for s in seqs],
                slots,
                [s.kv_table.blocks for s in seqs],
                [len(s.tokens) for s in seqs],
                [_sampling_row(s) for s in seqs],
                [prefill_chunk(j, self.config.block_size) for j in group],
                samples,
                num_steps=self.config.num_decode_steps if max(len(s) for s in slots) > 1 else 1,
                num_top=num_top,
            )
        except Exception as error:
            self._fail([s.request for s in seqs] + [j.request for j in group], error)
            return
        self._take_decoded(seqs, slots, decoded)
        self._take_prefilled(group, sampled, prefilled)

    def _run_decodes(self, seqs: list[Seq], slots: list[list[int]], num_top: int) -> None:
        """One decode call for the running samples (`slots`: the slots each feeds) and its tokens."""
        self.num_decode_calls += 1
        try:
            # One program per configured step count: a call near the end runs a few idle steps.
            multi = max(len(s) for s in slots) > 1
            res = self.runner.decode(
                [s.tokens[-1] for s in seqs],
                slots,
                [s.kv_table.blocks for s in seqs],
                [len(s.tokens) for s in seqs],
                [_sampling_row(s) for s in seqs],
                num_steps=self.config.num_decode_steps if multi else 1,
                num_top=num_top,
            )
        except Exception as error:
            self._fail([s.request for s in seqs], error)
            return
        self._take_decoded(seqs, slots, res)

    def _take_decoded(self, seqs: list[Seq], slots: list[list[int]], res: StepResult) -> None:
        """Append a decode call's tokens (`res` arrays [num_steps, n, ...]) to its samples."""
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
                        if seq.finished:  # (`_append_token` may have finished it)
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
        self.num_prefill_calls += 1
        try:
            res = self.runner.prefill_chunks(
                [prefill_chunk(j, self.config.block_size) for j in group], samples, num_top=num_top
            )
        except Exception as error:
            self._fail([j.request for j in group], error)
            return
        self._take_prefilled(group, seqs, res)

    def _take_prefilled(self, group: list[PrefillJob], seqs: list[Seq], res: StepResult) -> None:
        """Record that `group`'s chunks ran and append each sampled token (row i: `seqs[i]`)."""
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
            output = request_output(request)
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
        reason = stop_reason(seq, self.eos_token_ids, self.detokenize, self.config.max_model_len)
        if reason is not None:
            self._finish(seq, reason)

    def _append_plain_tokens(self, seq: Seq, tokens: list[int], logprobs: list[float]) -> None:
        """`_append_token` over the tokens one call made for a sample without stop strings or top
        logprobs: the same stops (EOS and stop tokens first, then the length limits), in bulk."""
        if seq.weight_version is None:
            seq.weight_version = self.weight_version
        count, reason = plain_tokens_stop(seq, tokens, self.eos_token_ids, self.config.max_model_len)
        seq.tokens.extend(tokens[:count])
        seq.logprobs.extend(logprobs[:count])
        self.num_generated_tokens += count
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Seq, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        if seq.request.finished and seq.request.request_id in self._requests:
            del self._requests[seq.request.request_id]
            self._finished.append(request_output(seq.request))

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free

    # -- counters a worker can report ---------------------------------------------------
    @property
    def num_prefix_cache_hit_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache instead of being computed (to the
        token: partial blocks count the tokens taken from them)."""
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
            "prefix_cache_partial_hit_tokens": self.scheduler.num_prefix_cache_partial_hit_tokens,
            "partial_block_copies": self.kv.num_partial_copies,
            "cached_partial_blocks": pool.num_cached_partial,
            "computed_prefill_tokens": self.scheduler.num_computed_prefill_tokens,
            "cached_blocks": pool.num_cached,
            "evicted_blocks": pool.num_evictions,
        }


def _sampling_row(seq: Seq) -> tuple[float, float, int, int, int, int]:
    p = seq.request.params
    assert p.seed is not None  # `add_request` draws one when the request has none
    index, step = seq.sample_index + p.sample_offset, seq.num_generated + p.step_offset
    return (float(p.temperature), float(p.top_p), p.top_k, p.seed, index, step)


def prefill_chunk(job: PrefillJob, block_size: int) -> PrefillChunk:
    """This step's chunk of `job`: its tokens, the slots their K/V go to, and the block table
    through which they read the job's earlier tokens (computed, shared or prefix-cached)."""
    bs = block_size
    assert job.table is not None  # the scheduler allocated it when it started the job
    blocks = job.table.blocks
    slots = [blocks[i // bs] * bs + i % bs for i in range(job.chunk_start, job.chunk_end)]
    return PrefillChunk(job.chunk, job.chunk_start, slots, blocks)
