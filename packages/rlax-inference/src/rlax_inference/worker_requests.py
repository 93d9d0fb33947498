"""The worker's requests: taking them from the I/O thread, refusing those too large, admitting
the others into the engine round robin across clients, stepping the engine and posting the
results.

`RequestServing` is one half of `rlax_inference.worker_process.Worker` (the other,
`rlax_inference.worker_weights.WeightFollowing`, loads the weights); the engine thread
calls both.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import rlax_protocol as rp
from rlax_inference.admission import AdmissionQueue
from rlax_inference.agent_loop import AgentLoop, AgentResult
from rlax_inference.engine import EngineConfig, LLMEngine, RequestOutput
from rlax_inference.sequence import SamplingParams
from rlax_inference.worker_config import WorkerConfig
from rlax_inference.worker_io import Cancel, Job, WorkerIO

__all__ = ["RequestServing", "TailText", "engine_params", "engine_sequences", "shown_id"]

log = logging.getLogger("rlax.worker")


class TailText:
    """`LLMEngine`'s `detokenize`: the text of a sample's last tokens, as many as can hold
    the longest stop string admitted so far (a character is at most 4 byte tokens), so each
    new token costs a bounded decode, not one of the whole sample."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.window = 1

    def need(self, stop: Sequence[str]) -> None:
        if stop:
            self.window = max(self.window, 4 * max(len(s) for s in stop) + 16)

    def __call__(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens[-self.window :]))


class RequestServing:
    """The request-serving half of `Worker` (whose `__init__` sets every attribute below)."""

    config: WorkerConfig
    engine_config: EngineConfig
    engine: LLMEngine | None
    agent: AgentLoop | None
    detokenize: TailText | None
    io: WorkerIO | None
    version: int | None
    # Decoded, not in the engine yet: no weights yet, a reload first, or no room.
    _queue: AdmissionQueue
    _admitted: dict[int, rp.GenerateRequest]
    # Requests that resume partial rollouts: one engine request per sample ("key/position"),
    # their outputs gathered here until the last one finishes.
    _resumed: dict[int, list[RequestOutput | None]]
    num_refused: dict[str, int]
    num_aborted: int
    # WorkerStats totals.
    reloads: int
    generated_tokens: int
    active_s: float
    engine_s: float
    compile_s: float
    reload_s: float
    shared_weight_bytes: int

    def _take_inbox(self, wait_s: float) -> None:
        assert self.io is not None
        inbox = self.io.inbox
        try:
            item = inbox.get(timeout=wait_s) if wait_s > 0 else inbox.get_nowait()
            while True:
                if isinstance(item, Job):
                    self._intake(item)
                else:
                    self._cancel(item)
                item = inbox.get_nowait()
        except queue.Empty:
            return

    def _intake(self, job: Job) -> None:
        """Queue a decoded request, or refuse it at once when it asks for more than this
        worker gives (`RequestLimits`, the engine's sizes)."""
        ec = self.engine_config
        why = self.config.limits.check(
            job.request, max_num_seqs=ec.max_num_seqs, max_model_len=ec.max_model_len
        )
        if why is None:
            self._queue.add(job, time.monotonic())
            return
        assert self.io is not None
        self.num_refused["too_large"] += 1
        self.io.post(job.key, rp.ErrorReply(code="too_large", message=f"{shown_id(job.request)}: {why}"))

    def _cancel(self, cancel: Cancel) -> None:
        """The client is gone: forget a queued request, abort an admitted one (its blocks are freed)."""
        self._queue.remove({cancel.key})
        if self.agent is not None:
            self.agent.cancel(cancel.key)
        request = self._admitted.pop(cancel.key, None)
        if request is not None and self.engine is not None:
            for engine_id in _engine_ids(cancel.key, request):
                self.engine.abort(engine_id)
            self._resumed.pop(cancel.key, None)
            self.num_aborted += 1

    def _admit(self, loadable: Callable[[int], bool]) -> None:
        """Move queued requests into the engine, round robin across clients (`AdmissionQueue`),
        while it has room for their samples: the rest wait here, where a client that was not
        served for a while goes first, rather than in the engine's arrival-ordered queue.
        `loadable(version)`: whether another version than the loaded one can be loaded now."""
        engine, io = self.engine, self.io
        assert engine is not None and io is not None
        capacity = self.engine_config.max_num_seqs
        room = capacity - engine_sequences(engine)
        for queued in self._queue.admissible(self.version, loadable):
            job, request = queued.job, queued.job.request
            if request.n > room and room < capacity:
                break  # the engine is full; this client keeps its turn
            self._queue.served(queued)
            try:
                params = engine_params(request)
                if self.detokenize is not None:
                    self.detokenize.need(params.stop)
                if request.agent is not None:
                    if self.agent is None:
                        raise ValueError(
                            "agent: this worker was started without the run's task (no environments)"
                        )
                    if self.detokenize is not None:
                        self.detokenize.need(self.agent.codec.stop_strings)
                    self.agent.start(job.key, request, params)
                    room -= request.n
                    continue
                if request.resume:
                    self._add_resumed(engine, job.key, request, params)
                else:
                    engine.add_request(str(job.key), request.prompt_token_ids, params)
            except Exception as error:  # a request the engine refuses fails alone, before it is scheduled
                if not isinstance(error, ValueError | TypeError | OverflowError):
                    log.exception("request %r refused", request.request_id)
                message = str(error).replace(f"request '{job.key}/", f"request '{request.request_id}/")
                message = message.replace(f"request '{job.key}'", f"request {request.request_id!r}")
                if request.request_id not in message:
                    message = f"{request.request_id}: {message}"
                io.post(job.key, rp.ErrorReply(code="malformed", message=message))
                continue
            room -= request.n
            self._admitted[job.key] = request

    def _add_resumed(
        self, engine: LLMEngine, key: int, request: rp.GenerateRequest, params: SamplingParams
    ) -> None:
        """A request continuing partial rollouts: each sample is an engine request of its own
        (its prompt is the request's plus its tokens so far) that draws the uninterrupted
        sample's keys from its place on (`SamplingParams.sample_offset`/`step_offset`); the
        shared prompt's blocks come from the prefix cache; under `EngineConfig.keep_stale_kv`
        so may the K/V of its tokens so far, as the earlier weights computed them, when this
        worker ran its last segment. All or none are added."""
        added: list[str] = []
        try:
            for engine_id, resumed in zip(_engine_ids(key, request), request.resume, strict=True):
                one = dataclasses.replace(
                    params, n=1, sample_offset=resumed.sample_index, step_offset=len(resumed.token_ids)
                )
                tokens = request.prompt_token_ids + resumed.token_ids
                engine.add_request(engine_id, tokens, one, reuse_stale_kv=True)
                added.append(engine_id)
        except Exception:
            for engine_id in added:
                engine.abort(engine_id)
            raise
        self._resumed[key] = [None] * len(request.resume)

    def _step(self, round_start: float) -> None:
        engine = self.engine
        assert engine is not None
        if self.config.max_delay_s > 0:  # chaos.max_delay_s; unseeded: timing is the point
            time.sleep(random.uniform(0.0, self.config.max_delay_s))
            round_start = time.monotonic()
        compiled_before = dict(engine.runner.num_compilations)
        started = time.monotonic()
        outputs = engine.step()
        ended = time.monotonic()
        if engine.runner.num_compilations != compiled_before:
            self.compile_s += ended - started  # a shape the warm-up did not cover
            round_start = ended  # not generation time either
            new = {k: v - compiled_before.get(k, 0) for k, v in engine.runner.num_compilations.items()}
            log.info("compiled new shapes during the run in %.1fs: %s", ended - started, new)
        else:
            self.engine_s += ended - started
        self.active_s += ended - round_start  # this round's version check, reload and step
        for output in outputs:
            if self.agent is not None and self.agent.owns(output.request_id):
                self._post_agent_results(self.agent.on_output(output))
            elif "/" in output.request_id:
                self._finish_resumed(output)
            else:
                self._finish(output)

    def _post_agent_results(self, results: list[AgentResult]) -> None:
        assert self.io is not None
        for key, request, samples, version in results:
            self.generated_tokens += sum(sum(s.model_mask) for s in samples)
            result = rp.GenerateResult(
                request_id=request.request_id,
                samples=tuple(samples),
                weight_version=(self.version or 0) if version is None else version,
                stats=self.stats(),
            )
            self.io.post(key, result)

    def _finish(self, output: RequestOutput) -> None:
        assert self.io is not None
        key = int(output.request_id)
        request = self._admitted.pop(key, None)
        if request is None:
            return  # cancelled
        if output.error:
            message = f"{request.request_id}: {output.error}"
            self.io.post(key, rp.ErrorReply(code="internal", message=message))
            return
        completions = sorted(output.outputs, key=lambda c: c.sample_index)
        self._post_samples(key, request, completions, output.weight_version)

    def _finish_resumed(self, output: RequestOutput) -> None:
        """One resumed sample finished; the request is answered once all of its have."""
        key_text, position = output.request_id.split("/")
        key = int(key_text)
        parts = self._resumed.get(key)
        if parts is None:
            return  # cancelled
        parts[int(position)] = output
        if any(part is None for part in parts):
            return
        del self._resumed[key]
        request = self._admitted.pop(key)
        outputs = [part for part in parts if part is not None]
        failed = next((part.error for part in outputs if part.error), None)
        if failed is not None:
            assert self.io is not None
            self.io.post(key, rp.ErrorReply(code="internal", message=f"{request.request_id}: {failed}"))
            return
        # The worker swaps weights only once the engine is empty: one version for all of them.
        completions = [part.outputs[0] for part in outputs]
        self._post_samples(key, request, completions, outputs[0].weight_version)

    def _post_samples(
        self, key: int, request: rp.GenerateRequest, completions: Sequence[Any], version: int | None
    ) -> None:
        assert self.io is not None
        with_logprobs = request.sampling.logprobs
        samples = tuple(
            rp.Sample(
                token_ids=tuple(int(t) for t in c.tokens),
                logprobs=tuple(float(x) for x in c.logprobs) if with_logprobs else (),
                finish_reason=c.finish_reason.wire,
                top_logprobs=tuple({int(i): float(lp) for i, lp in t} for t in c.top_logprobs),
            )
            for c in completions
        )
        self.generated_tokens += sum(len(s.token_ids) for s in samples)
        result = rp.GenerateResult(
            request_id=request.request_id,
            samples=samples,
            weight_version=(self.version or 0) if version is None else version,
            stats=self.stats(),
        )
        self.io.post(key, result)

    def stats(self) -> rp.WorkerStats:
        return rp.WorkerStats(
            generated_tokens=self.generated_tokens,
            active_s=self.active_s,
            engine_s=self.engine_s,
            compile_s=self.compile_s,
            reload_s=self.reload_s,
            reloads=self.reloads,
            shared_weight_bytes=self.shared_weight_bytes,
        )


def _engine_ids(key: int, request: rp.GenerateRequest) -> list[str]:
    """The engine's ids of a request: its key, or one "key/position" per resumed sample."""
    if not request.resume:
        return [str(key)]
    return [f"{key}/{position}" for position in range(len(request.resume))]


def engine_sequences(engine: LLMEngine) -> int:
    """Samples in the engine that have not finished (waiting, prefilling or running)."""
    scheduler = engine.scheduler
    jobs = (*scheduler.waiting, *scheduler.prefilling)
    return len(scheduler.running) + sum(len(job.seqs) for job in jobs)


def shown_id(request: rp.GenerateRequest) -> str:
    """The request's id for a reply or a log line (a hostile one cut short)."""
    rid = request.request_id
    return rid if len(rid) <= 80 else f"{rid[:80]}...({len(rid)} chars)"


def engine_params(request: rp.GenerateRequest) -> SamplingParams:
    """Protocol sampling settings -> engine `SamplingParams` (ValueError names a bad field).

    A request without a seed keeps `seed=None`: the engine gives each such request its own.
    """
    s = request.sampling
    return SamplingParams(
        n=request.n,
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        stop=tuple(s.stop_strings),
        logprobs=s.top_logprobs,
    )
