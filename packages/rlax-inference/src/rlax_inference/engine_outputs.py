"""What an `LLMEngine` returns: each request's samples, their tokens, log-probs and finish
reasons, and the weight version that made them."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlax_inference.sequence import FinishReason, Request

__all__ = ["CompletionOutput", "RequestOutput", "request_output"]


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
    with finish reason ABORT. num_cached_tokens: its prompt tokens whose K/V came from the
    prefix cache when it was admitted (to the token; 0 if it never was).
    """

    request_id: str
    prompt: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None
    num_cached_tokens: int = 0

    @property
    def weight_version(self) -> int | None:
        """The one weight version behind every sample (None if nothing was generated)."""
        versions = {c.weight_version for c in self.outputs if c.weight_version is not None}
        if len(versions) > 1:
            raise AssertionError(f"request {self.request_id} mixes weight versions {sorted(versions)}")
        return versions.pop() if versions else None


def request_output(request: Request) -> RequestOutput:
    """The output of `request` as its samples stand now (an unfinished sample: reason ABORT)."""
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
    return RequestOutput(request.request_id, list(request.prompt), outs, None, request.num_cached_tokens or 0)
