"""Bad requests are refused before they take blocks, a failure inside a step ends only the
requests it touched, and unseeded requests draw distinct, reproducible seeds."""

import math

import jax
import numpy as np
import pytest
from tiny_model import CONFIG, PARAMS, naive_greedy

from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.sampler import SamplingBatch, sample
from rlax_inference.sequence import FinishReason, SamplingParams

VOCAB = CONFIG.vocab_size  # 128
PROMPT = [5, 17, 33, 2, 90, 41, 7, 64, 11, 3]


def make_engine(detokenize=None, **kw):
    cfg = {
        "block_size": 8,
        "num_blocks": 48,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 64,
        "eos_token_ids": (),
    }
    cfg.update(kw)
    return LLMEngine(CONFIG, PARAMS, EngineConfig(**cfg), detokenize=detokenize)


def assert_clean_and_serving(engine):
    """No blocks held, nothing unfinished, and a valid request still decodes exactly."""
    assert engine.num_free_blocks == engine.config.num_blocks
    assert not engine.has_unfinished
    assert not engine.scheduler.has_unfinished
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6))
    assert out.error is None
    assert out.outputs[0].tokens == naive_greedy(PARAMS, PROMPT, 6)
    assert engine.num_free_blocks == engine.config.num_blocks
    assert not engine.has_unfinished


# -- fields that depend on the model: rejected by add_request -------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        (PROMPT, SamplingParams(logprobs=1000), r"logprobs=1000 .*vocabulary size 128"),
        (PROMPT, SamplingParams(logprobs=VOCAB + 1), r"logprobs=129 .*vocabulary size 128"),
        (PROMPT, SamplingParams(top_k=VOCAB + 1), r"top_k=129 .*vocabulary size 128"),
        (PROMPT, SamplingParams(stop_token_ids=(3, VOCAB)), r"stop_token_ids.*128 .*\[0, 128\)"),
        ([1, -1, 2], SamplingParams(), r"prompt token -1 at index 1 .*\[0, 128\)"),
        ([1, 2, VOCAB], SamplingParams(), r"prompt token 128 at index 2 .*\[0, 128\)"),
        ([1, 2.5], SamplingParams(), r"prompt token 2.5 at index 1 .*int"),
        ([], SamplingParams(), r"at least one token"),
        ([1] * 64, SamplingParams(), r"context length is 64"),
        (PROMPT, SamplingParams(n=9), r"n=9 .*max_num_seqs=8"),
    ],
)
def test_out_of_range_request_is_refused_before_it_is_scheduled(prompt, params, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.scheduler.waiting
    assert_clean_and_serving(engine)
    # The same id is free again: the refused request left nothing behind.
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=2))


def test_logprobs_1000_no_longer_leaks_blocks_or_wedges_the_engine():
    """The review's case: it used to raise inside step() holding 2 blocks, forever unfinished."""
    engine = make_engine()
    outs = engine.generate([PROMPT, PROMPT], [SamplingParams(logprobs=1000), SamplingParams(max_tokens=3)])
    assert "SamplingParams.logprobs=1000" in outs[0].error and not outs[0].outputs
    assert outs[1].error is None and len(outs[1].outputs[0].tokens) == 3
    assert_clean_and_serving(engine)


def test_fields_at_the_vocabulary_limit_are_served():
    engine = make_engine()
    params = SamplingParams(temperature=1.0, top_k=VOCAB, logprobs=VOCAB, stop_token_ids=(VOCAB - 1,), seed=1)
    (out,) = engine.generate([[VOCAB - 1, 0, 4]], params)
    assert out.error is None
    (c,) = out.outputs
    assert all(len(top) == VOCAB for top in c.top_logprobs)
    # With every token listed, the probabilities of the full distribution sum to one.
    np.testing.assert_allclose(np.exp([lp for _, lp in c.top_logprobs[0]]).sum(), 1.0, rtol=1e-4)
    assert_clean_and_serving(engine)


# -- fields that do not depend on the model: rejected by SamplingParams -----------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"n must be an int >= 1, got 0"),
        ({"n": True}, r"n must be an int >= 1, got True"),
        ({"temperature": -0.5}, r"temperature must be a finite number >= 0, got -0.5"),
        ({"temperature": math.nan}, r"temperature .* got nan"),
        ({"temperature": math.inf}, r"temperature .* got inf"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p .* got 1.5"),
        ({"top_p": math.nan}, r"top_p .* got nan"),
        ({"top_p": "0.9"}, r"top_p .* got '0.9'"),
        ({"top_k": -1}, r"top_k must be an int >= 0, got -1"),
        ({"max_tokens": 0}, r"max_tokens must be an int >= 1, got 0"),
        ({"logprobs": -1}, r"logprobs must be an int >= 0, got -1"),
        ({"seed": -1}, r"seed must be None or an int in \[0, 2\*\*32\), got -1"),
        ({"seed": 2**32}, r"seed .* got 4294967296"),
        ({"stop_token_ids": (1, -2)}, r"stop_token_ids must be a tuple of ints >= 0, got \(1, -2\)"),
        ({"stop_token_ids": (1.0,)}, r"stop_token_ids .* got \(1.0,\)"),
        ({"stop_token_ids": [1]}, r"stop_token_ids .* got \[1\]"),
        ({"stop": ("",)}, r"stop must be a tuple of non-empty strings"),
        ({"ignore_eos": 1}, r"ignore_eos must be a bool, got 1"),
    ],
)
def test_sampling_params_reject_out_of_range_fields(kwargs, message):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{message}"):
        SamplingParams(**kwargs)


# -- a failure inside step() ends the requests it touched, nothing else ---------------------


class Boom(RuntimeError):
    pass


def fail_once(engine, method):
    """Make `engine.runner.<method>` raise on its next call only."""
    real = getattr(engine.runner, method)
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise Boom(f"forced {method} failure")
        return real(*args, **kwargs)

    setattr(engine.runner, method, flaky)
    return calls


def run_to_completion(engine):
    finished = {}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            finished[out.request_id] = out
    assert not engine.has_unfinished
    return finished


def test_a_failing_prefill_ends_its_requests_and_frees_their_blocks():
    engine = make_engine()
    engine.add_request("a", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=5))
    engine.add_request("b", PROMPT[:4], SamplingParams(max_tokens=5))
    fail_once(engine, "prefill_chunks")
    finished = engine.step()  # must not raise: the failure is the requests'
    assert {o.request_id for o in finished} == {"a", "b"}
    for out in finished:
        assert "forced prefill_chunks failure" in out.error
        assert all(c.finish_reason is FinishReason.ABORT for c in out.outputs)
    assert_clean_and_serving(engine)


def test_a_failing_decode_ends_the_running_requests_and_frees_their_blocks():
    engine = make_engine()
    engine.add_request("a", PROMPT, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3))
    assert engine.step() == []  # prefill: each sample has its first token
    fail_once(engine, "decode")
    (out,) = engine.step()
    assert out.request_id == "a" and "forced decode failure" in out.error
    assert [len(c.tokens) for c in out.outputs] == [1, 1]  # what was generated before the failure
    assert all(c.finish_reason is FinishReason.ABORT for c in out.outputs)
    assert_clean_and_serving(engine)


def test_a_failure_of_one_request_spares_the_others_in_its_step():
    """A stop-string check that raises for one request: only that request ends."""

    def detokenize(tokens):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "forced detokenize failure")

    engine = make_engine(detokenize=detokenize)
    engine.add_request("text", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, stop=("x",)))
    engine.add_request("ids", PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    finished = run_to_completion(engine)
    assert "forced detokenize failure" in finished["text"].error
    assert finished["ids"].error is None
    assert finished["ids"].outputs[0].tokens == naive_greedy(PARAMS, PROMPT, 6)
    assert_clean_and_serving(engine)


def test_a_step_failure_is_logged_with_its_traceback(caplog):
    engine = make_engine()
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2))
    fail_once(engine, "prefill_chunks")
    with caplog.at_level("ERROR", logger="rlax_inference.engine"):
        engine.step()
    (record,) = [r for r in caplog.records if r.name == "rlax_inference.engine"]
    assert "'a'" in record.getMessage() and record.exc_info is not None


# -- seeds --------------------------------------------------------------------------------------


def sample_tokens(engine, prompts, params):
    outs = engine.generate(prompts, params)
    assert all(o.error is None for o in outs)
    return [[tuple(c.tokens) for c in o.outputs] for o in outs]


def test_unseeded_requests_of_one_prompt_draw_different_samples():
    engine = make_engine()
    params = SamplingParams(temperature=1.0, max_tokens=12)
    assert params.seed is None
    outs = sample_tokens(engine, [PROMPT] * 4, params)
    assert len({o[0] for o in outs}) == 4, "unseeded requests must not share a seed"


def test_unseeded_requests_get_distinct_seeds_reproducible_from_the_engine_seed():
    def seeds(engine_seed, count=64):
        engine = make_engine(seed=engine_seed)
        for i in range(count):
            engine.add_request(f"r{i}", PROMPT, SamplingParams(temperature=1.0))
        return [engine._requests[f"r{i}"].params.seed for i in range(count)]

    first = seeds(0)
    assert len(set(first)) == len(first)
    assert all(isinstance(s, int) and 0 <= s < 2**32 for s in first)
    assert seeds(0) == first
    assert seeds(1) != first


def test_unseeded_samples_are_reproducible_for_the_same_engine_seed_and_order():
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10)
    a = sample_tokens(make_engine(seed=5), [PROMPT, PROMPT[:5]], params)
    b = sample_tokens(make_engine(seed=5), [PROMPT, PROMPT[:5]], params)
    c = sample_tokens(make_engine(seed=6), [PROMPT, PROMPT[:5]], params)
    assert a == b
    assert a != c


def test_seeded_requests_keep_their_seed_whatever_the_engine_seed():
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=7)
    engine = make_engine(seed=123)
    engine.add_request("s", PROMPT, params)
    assert engine._requests["s"].params.seed == 7
    engine.abort("s")
    a = sample_tokens(make_engine(seed=0), [PROMPT], params)
    b = sample_tokens(make_engine(seed=99), [PROMPT], params)
    # An unseeded request ahead of it does not move its draws either.
    mixed = make_engine(seed=0)
    c = sample_tokens(mixed, [PROMPT, PROMPT], [SamplingParams(temperature=1.0, max_tokens=10), params])[1:]
    assert a == b == c


def test_engine_seed_must_be_an_int_in_range():
    with pytest.raises(ValueError, match=r"EngineConfig.seed must be an int >= 0, got -1"):
        EngineConfig(seed=-1)


def test_sampler_top_logprobs_beyond_a_small_vocabulary_are_padded():
    """The runner rounds num_top up to a compile bucket (up to 64), past a vocabulary under 64."""
    logits = jax.random.normal(jax.random.key(0), (2, 40))
    batch = SamplingBatch.from_rows([(1.0, 1.0, 0, 3, 0, 0), (0.0, 1.0, 0, 3, 1, 0)])
    out = sample(logits, batch, num_top=64)
    assert out.top_ids.shape == out.top_logprobs.shape == (2, 64)
    np.testing.assert_array_equal(out.top_ids[:, :40], np.argsort(-np.asarray(logits), axis=1, kind="stable"))
    np.testing.assert_allclose(np.exp(out.top_logprobs[:, :40]).sum(axis=1), 1.0, rtol=1e-5)
    assert np.all(np.isneginf(out.top_logprobs[:, 40:]))
