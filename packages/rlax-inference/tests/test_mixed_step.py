"""Prefill folded into the decode call (`EngineConfig.fold_prefill`): requests that arrive
while others decode join the running batch in one model call, and every token and log-prob
is what separate prefill and decode calls give."""

import dataclasses
import pathlib

import numpy as np
import pytest
from tiny_model import CONFIG, PARAMS, naive_greedy, teacher_forced_logprobs

from rlax_core.config import load_config
from rlax_data.task_from_config import build_task
from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.model_runner import COMPILATIONS, MIXED_PREFILL_ROWS
from rlax_inference.sequence import SamplingParams
from rlax_inference.warm_up import WarmUp
from rlax_inference.worker_process import engine_config_fields

REPO = pathlib.Path(__file__).resolve().parents[3]

WINDOWED = dataclasses.replace(CONFIG, sliding_window=6)


def make_engine(config=CONFIG, **overrides):
    options = dict(
        block_size=8, num_blocks=96, max_num_seqs=32, max_model_len=128, max_num_batched_tokens=64,
        prefill_chunk_size=16, eos_token_ids=(), fold_prefill="on",
    )  # fmt: skip
    return LLMEngine(config, PARAMS, EngineConfig(**{**options, **overrides}))


def prompts(rng, lengths):
    return [[int(t) for t in rng.integers(3, CONFIG.vocab_size, size=n)] for n in lengths]


def staggered(engine, ps, params, *, every=2):
    """One request first, then one more every `every` steps while the earlier ones decode."""
    outs, pending = {}, list(enumerate(ps))
    step = 0
    while pending or engine.has_unfinished:
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        outs.update({o.request_id: o for o in engine.step()})
        step += 1
    return [outs[f"r{i}"] for i in range(len(ps))]


# The sliding-window and multi-step variants compile programs of their own: `nox -s slow`.
@pytest.mark.parametrize(
    "config,num_steps",
    [
        (CONFIG, 1),
        pytest.param(WINDOWED, 1, marks=pytest.mark.slow),
        pytest.param(CONFIG, 4, marks=pytest.mark.slow),
    ],
    ids=["full", "sliding_window", "multi_step"],
)
def test_requests_joining_a_decoding_batch_ride_in_its_call_and_decode_as_alone(config, num_steps):
    # Prompts of 30-45 tokens: chunks of 16 over several steps, some with no sample (not last).
    ps = prompts(np.random.default_rng(3), (5, 33, 11, 45, 19, 30))
    engine = make_engine(config, num_decode_steps=num_steps)
    outs = staggered(engine, ps, SamplingParams(temperature=0.0, max_tokens=12))
    assert engine.num_mixed_calls >= len(ps) - 1  # every late request's chunks rode along
    for p, out in zip(ps, outs, strict=True):
        tokens = out.outputs[0].tokens
        assert tokens == naive_greedy(PARAMS, p, 12, config=config)
        np.testing.assert_allclose(
            out.outputs[0].logprobs, teacher_forced_logprobs(PARAMS, p, tokens, config=config), atol=1e-5
        )


@pytest.mark.parametrize("num_steps", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_folded_and_separate_calls_sample_the_same_tokens_and_logprobs(num_steps):
    """Sampled (top-p, n = 3, top log-probs): the same seeds give the same tokens either way."""
    ps = prompts(np.random.default_rng(4), (7, 21, 9, 40, 13))
    params = SamplingParams(n=3, temperature=0.9, top_p=0.9, max_tokens=10, logprobs=2, seed=11)
    folded = make_engine(num_decode_steps=num_steps)
    separate = make_engine(fold_prefill="off", num_decode_steps=num_steps)
    got, want = staggered(folded, ps, params), staggered(separate, ps, params)
    assert folded.num_mixed_calls > 0 and separate.num_mixed_calls == 0
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.tokens == y.tokens
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
            assert [[i for i, _ in t] for t in x.top_logprobs] == [[i for i, _ in t] for t in y.top_logprobs]
            np.testing.assert_allclose(
                [[v for _, v in t] for t in x.top_logprobs],
                [[v for _, v in t] for t in y.top_logprobs],
                atol=1e-5,
            )


def test_more_chunks_than_a_mixed_step_holds_run_in_prefill_calls_beside_it():
    engine = make_engine(max_num_batched_tokens=128, prefill_chunk_size=None)
    rng = np.random.default_rng(5)
    first = prompts(rng, (6,))[0]
    engine.add_request("first", first, SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()
    late = prompts(rng, (4, 9, 5, 12, 7, 10, 3))  # 7 > MIXED_PREFILL_ROWS in one step
    assert len(late) > MIXED_PREFILL_ROWS
    for i, p in enumerate(late):
        engine.add_request(f"late{i}", p, SamplingParams(temperature=0.0, max_tokens=6))
    outs = {}
    while engine.has_unfinished:
        outs.update({o.request_id: o for o in engine.step()})
    assert engine.num_mixed_calls >= 1
    assert outs["first"].outputs[0].tokens == naive_greedy(PARAMS, first, 20)
    for i, p in enumerate(late):
        assert outs[f"late{i}"].outputs[0].tokens == naive_greedy(PARAMS, p, 6)


def test_a_next_turn_from_the_prefix_cache_rides_along_after_its_cached_tokens():
    """A turn that continues a finished sequence starts after its cached (partly filled) blocks:
    the mixed step's prefill reads them through its block table."""
    engine = make_engine()
    rng = np.random.default_rng(6)
    first, other = prompts(rng, (13, 9))
    engine.add_request("other", other, SamplingParams(temperature=0.0, max_tokens=40))
    engine.add_request("turn1", first, SamplingParams(temperature=0.0, max_tokens=7))
    outs = {}
    while "turn1" not in outs:
        outs.update({o.request_id: o for o in engine.step()})
    turn2 = first + outs["turn1"].outputs[0].tokens + [5, 6, 7]
    mixed_before, hits_before = engine.num_mixed_calls, engine.num_prefix_cache_hit_tokens
    engine.add_request("turn2", turn2, SamplingParams(temperature=0.0, max_tokens=8))
    while engine.has_unfinished:
        outs.update({o.request_id: o for o in engine.step()})
    assert engine.num_mixed_calls > mixed_before  # "other" was still decoding
    assert engine.num_prefix_cache_hit_tokens > hits_before
    assert outs["turn2"].outputs[0].tokens == naive_greedy(PARAMS, turn2, 8)
    assert outs["other"].outputs[0].tokens == naive_greedy(PARAMS, other, 40)


# Compiling every decode, prefill and mixed shape up to 32 rows takes ~50 s: `nox -s slow`.
@pytest.mark.slow
def test_mixed_programs_compiled_before_serving_cover_a_staggered_run():
    engine = make_engine(num_decode_steps=4)
    engine.runner.compile_shapes(max_chunk_tokens=16, decode_rows=32, decode_steps=(1, 4), mixed=True)
    compiled = dict(COMPILATIONS)
    ps = prompts(np.random.default_rng(7), (5, 33, 11, 45, 19, 30, 8, 26))
    staggered(engine, ps, SamplingParams(n=2, temperature=1.0, max_tokens=9, seed=1), every=1)
    assert engine.num_mixed_calls > 0
    assert dict(COMPILATIONS) == compiled


def test_a_failing_mixed_call_ends_the_requests_of_both_parts_and_the_engine_goes_on(monkeypatch):
    engine = make_engine()
    rng = np.random.default_rng(8)
    a, b, c = prompts(rng, (6, 10, 7))
    engine.add_request("decoding", a, SamplingParams(temperature=0.0, max_tokens=10))
    engine.step()
    engine.add_request("joining", b, SamplingParams(temperature=0.0, max_tokens=5))

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "decode_with_prefill", broken)
    finished = {o.request_id: o for o in engine.step()}
    assert set(finished) == {"decoding", "joining"}
    assert all("device lost" in o.error for o in finished.values())
    monkeypatch.undo()
    engine.add_request("after", c, SamplingParams(temperature=0.0, max_tokens=5))
    outs = {}
    while engine.has_unfinished:
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["after"].outputs[0].tokens == naive_greedy(PARAMS, c, 5)


def test_a_worker_engine_folds_only_into_programs_compiled_before():
    """`fold_prefill="compiled"` (a worker's): an uncompiled mixed shape runs as separate
    calls and compiles nothing new; once compiled (as at a worker's warm-up), steps fold."""
    ps = prompts(np.random.default_rng(9), (6, 12, 9, 14))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    engine = make_engine(fold_prefill="compiled", max_num_seqs=16)
    before = COMPILATIONS["mixed"]
    outs = staggered(engine, ps, greedy)
    assert engine.num_mixed_calls == 0 and COMPILATIONS["mixed"] == before
    engine.runner.compile_mixed(16, 16, [(0.0, 1.0, 0, 0, 0, 0)])
    again = staggered(engine, ps, greedy)
    assert engine.num_mixed_calls > 0
    for p, a, b in zip(ps, outs, again, strict=True):
        assert a.outputs[0].tokens == b.outputs[0].tokens == naive_greedy(PARAMS, p, 8)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["controller.lag=2", "trainer.k=2"], 0),  # workers.fold_prefill is off by default
        (["workers.fold_prefill=true"], 0),  # synchronous steps, each worker takes its whole share at once
        (
            ["workers.fold_prefill=true", "controller.lag=2", "trainer.k=2"],
            5,
        ),  # the next step's groups: a prompt
        (
            ["workers.fold_prefill=true", "workers.max_inflight_groups=4"],
            5,
        ),  # a worker's share arrives in waves
    ],
)
def test_a_run_warms_up_mixed_steps_only_when_groups_join_running_ones(overrides, expected):
    config = load_config(REPO / "configs/demo.yaml", overrides)
    plan = WarmUp.for_run(config, build_task(config))
    assert plan.mixed_chunk_tokens == expected
    fold = engine_config_fields(config)["fold_prefill"]
    assert fold == ("compiled" if "workers.fold_prefill=true" in overrides else "off")


def test_a_multi_turn_run_warms_up_mixed_steps_for_short_next_turns():
    config = load_config(REPO / "configs/multiturn-demo.yaml", ["workers.fold_prefill=true"])
    plan = WarmUp.for_run(config, build_task(config))
    assert plan.mixed_chunk_tokens == 16  # an observation and the previous turn's last token
