"""Chunked prefill: a prompt fed in chunks through the paged cache gives what a prompt fed at once gives.

Each chunk attends to the earlier chunks' K/V through the block table and causally to
itself; the expected values come from runs that prefill every prompt in one piece and from
the model's own cache-free forward pass (`teacher_forced_logprobs`).
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_model import CONFIG, PARAMS, naive_greedy, teacher_forced_logprobs

from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.sequence import SamplingParams
from rlax_model import ModelConfig, init_params


def make_engine(config=CONFIG, params=PARAMS, **kw):  # type: ignore[no-untyped-def]
    cfg = dict(
        block_size=8, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128,
        eos_token_ids=(), enable_prefix_caching=False,
    )  # fmt: skip
    cfg.update(kw)
    return LLMEngine(config, params, EngineConfig(**cfg))


def record_chunks(engine: LLMEngine) -> list[tuple[int, int]]:
    """(start, length) of every prefill chunk the engine's runner is asked for (in prefill
    calls and in decode calls that fold chunks in)."""
    seen: list[tuple[int, int]] = []
    run, run_mixed = engine.runner.prefill_chunks, engine.runner.decode_with_prefill

    def spy(chunks, samples, **kw):  # type: ignore[no-untyped-def]
        seen.extend((c.start, len(c.tokens)) for c in chunks)
        return run(chunks, samples, **kw)

    def spy_mixed(*args, **kw):  # type: ignore[no-untyped-def]
        seen.extend((c.start, len(c.tokens)) for c in args[5])
        return run_mixed(*args, **kw)

    engine.runner.prefill_chunks = spy  # type: ignore[method-assign]
    engine.runner.decode_with_prefill = spy_mixed  # type: ignore[method-assign]
    return seen


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, CONFIG.vocab_size, size=n)] for n in lengths]


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_equals_whole_prompt_prefill(chunk):
    prompts = _prompts(1, [45, 23, 9, 60])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=4)
    chunked = make_engine(prefill_chunk_size=chunk)
    chunks = record_chunks(chunked)
    got = chunked.generate(prompts, params)
    whole = make_engine(enable_chunked_prefill=False).generate(prompts, params)
    assert max(n for _, n in chunks) <= chunk and any(start > 0 for start, _ in chunks)
    assert sum(n for _, n in chunks) == sum(map(len, prompts))
    assert chunked.num_computed_prefill_tokens == sum(map(len, prompts))
    for p, g, w in zip(prompts, got, whole, strict=True):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert gc.tokens == wc.tokens
            np.testing.assert_allclose(gc.logprobs, wc.logprobs, rtol=0, atol=1e-5)
            np.testing.assert_allclose(gc.logprobs, teacher_forced_logprobs(PARAMS, p, gc.tokens), atol=1e-5)


def test_a_step_mixes_decodes_and_a_long_prompts_chunks():
    """A budget of 24 tokens: running samples decode while a 70-token prompt trickles in."""
    short, long = _prompts(2, [5, 70])
    engine = make_engine(max_num_batched_tokens=24, max_num_seqs=4)
    chunks = record_chunks(engine)
    engine.add_request("short", short, SamplingParams(temperature=0.0, max_tokens=12))
    engine.step()  # the short prompt's prefill: it decodes from now on
    engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=4))
    outs = {}
    while engine.has_unfinished:
        for o in engine.step():
            outs[o.request_id] = o
    long_chunks = [n for start, n in chunks[1:]]
    assert len(long_chunks) >= 3 and max(long_chunks) <= 24 - 1  # one decode token beside each chunk
    for name, p, n in (("short", short, 12), ("long", long, 4)):
        c = outs[name].outputs[0]
        assert c.tokens == naive_greedy(PARAMS, p, n)
        np.testing.assert_allclose(c.logprobs, teacher_forced_logprobs(PARAMS, p, c.tokens), atol=1e-5)


def test_sliding_window_model_in_chunks():
    config = ModelConfig.tiny(max_position_embeddings=512, sliding_window=9)
    params = init_params(config, __import__("jax").random.key(1), std=0.25)
    prompts = _prompts(3, [40, 26])
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    got = make_engine(config, params, prefill_chunk_size=6).generate(prompts, sp)
    want = make_engine(config, params, enable_chunked_prefill=False).generate(prompts, sp)
    for g, w, p in zip(got, want, prompts, strict=True):
        assert g.outputs[0].tokens == w.outputs[0].tokens == naive_greedy(params, p, 4, config=config)
        np.testing.assert_allclose(g.outputs[0].logprobs, w.outputs[0].logprobs, rtol=0, atol=1e-5)


def test_weight_swap_in_the_middle_of_a_chunked_prefill_restarts_it():
    """A prefill whose first chunks ran under the old weights must not finish under the new ones."""
    [p] = _prompts(4, [50])
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    new = {**PARAMS, "embed": PARAMS["embed"] * 1.5}
    for policy in ("drop", "finish"):
        engine = make_engine(prefill_chunk_size=8)
        engine.add_request("r", p, sp)
        engine.step()  # 8 of 50 tokens under version 0
        engine.update_weights(new, 1, policy=policy)
        outs = []
        while engine.has_unfinished:
            outs += engine.step()
        c = outs[0].outputs[0]
        weights = PARAMS if policy == "finish" else new
        assert c.weight_version == (0 if policy == "finish" else 1)
        assert c.tokens == naive_greedy(weights, p, 3)
        np.testing.assert_allclose(c.logprobs, teacher_forced_logprobs(weights, p, c.tokens), atol=1e-5)
