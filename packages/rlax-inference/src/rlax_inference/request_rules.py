"""The engine's rules for a request: what it checks of one before scheduling it (this model's
vocabulary, a detokenizer for stop strings), the seed it gets when it has none, and when
one of its samples stops."""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence

import numpy as np

from rlax_inference.sequence import FinishReason, SamplingParams
from rlax_inference.sequence import Sequence as Seq

__all__ = ["SeedStream", "checked_prompt", "is_stop_token", "plain_tokens_stop", "stop_reason"]


class SeedStream:
    """The seeds given to requests without one: seed_k = (a * k + b) mod 2**32 for the k-th,
    with a odd (a bijection of k, so no two collide) and a, b drawn from `seed`."""

    def __init__(self, seed: int) -> None:
        a, b = np.random.default_rng(seed).integers(2**32, size=2, dtype=np.uint64).tolist()
        self._a: int = a | 1
        self._b: int = b
        self._drawn = 0

    def next(self) -> int:
        seed = (self._a * self._drawn + self._b) % 2**32
        self._drawn += 1
        return seed


def checked_prompt(
    prompt: Sequence[int], params: SamplingParams, *, vocab_size: int, can_detokenize: bool
) -> list[int]:
    """The prompt as ints; ValueError for what a model of `vocab_size` tokens (and an engine
    with or without a detokenizer) cannot run."""
    tokens = []
    for i, t in enumerate(prompt):
        try:
            tokens.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token {t!r} at index {i} is not an int") from None
    vocab = vocab_size
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
    if params.stop and not can_detokenize:
        raise ValueError("stop strings need an engine built with detokenize=")
    return tokens


def is_stop_token(params: SamplingParams, token: int, eos_token_ids: Collection[int]) -> bool:
    """EOS (unless the request ignores it) or one of the request's stop tokens."""
    return (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids


def stop_reason(
    seq: Seq,
    eos_token_ids: Collection[int],
    detokenize: Callable[[list[int]], str] | None,
    max_model_len: int,
) -> FinishReason | None:
    """Why `seq` stops at its latest token (None: it goes on). A stop string is looked for
    in `detokenize`'s text of its output and recorded in `seq.stop_string`."""
    p = seq.request.params
    token = seq.tokens[-1]
    if is_stop_token(p, token, eos_token_ids):
        return FinishReason.EOS
    if p.stop:
        text = detokenize(seq.output_tokens)  # type: ignore[misc]
        for s in p.stop:
            if s in text:
                seq.stop_string = s
                return FinishReason.STOP
    if seq.num_generated >= p.max_tokens or len(seq.tokens) >= max_model_len:
        return FinishReason.LENGTH
    return None


def plain_tokens_stop(
    seq: Seq, tokens: list[int], eos_token_ids: Collection[int], max_model_len: int
) -> tuple[int, FinishReason | None]:
    """How many of `tokens` (made by one call for a sample without stop strings) the sample
    keeps, and why it stops after them (None: it goes on): EOS and stop tokens first, then
    the length limits."""
    p = seq.request.params
    limit = min(p.max_tokens - seq.num_generated, max_model_len - len(seq.tokens))
    count, reason = min(len(tokens), limit), None
    for j in range(count):
        if is_stop_token(p, tokens[j], eos_token_ids):
            count, reason = j + 1, FinishReason.EOS
            break
    if reason is None and count == limit:
        reason = FinishReason.LENGTH
    return count, reason
