import dataclasses

import numpy as np
import pytest
from tiny_model import CONFIG, PARAMS, naive_greedy, teacher_forced_logprobs

from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.sequence import FinishReason, SamplingParams


def prompts(n, rng, lo=3, hi=40):
    return [[int(t) for t in rng.integers(3, CONFIG.vocab_size, size=rng.integers(lo, hi))] for _ in range(n)]


def make_engine(**kw):
    cfg = {
        "block_size": 8,
        "num_blocks": 96,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 512,
        "max_model_len": 128,
        "eos_token_ids": (),
    }
    cfg.update(kw)
    return LLMEngine(CONFIG, PARAMS, EngineConfig(**cfg))


@pytest.mark.parametrize("num_decode_steps", [1, 5])
def test_greedy_batch_matches_naive_decoding_and_teacher_forced_logprobs(num_decode_steps):
    rng = np.random.default_rng(0)
    ps = prompts(16, rng)
    engine = make_engine(num_decode_steps=num_decode_steps)
    outs = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=12))
    for p, out in zip(ps, outs):
        assert out.error is None
        (c,) = out.outputs
        assert c.tokens == naive_greedy(PARAMS, p, 12)
        assert c.finish_reason is FinishReason.LENGTH and c.weight_version == 0
        np.testing.assert_allclose(c.logprobs, teacher_forced_logprobs(PARAMS, p, c.tokens), atol=1e-5)
    assert engine.num_free_blocks == engine.config.num_blocks
    assert engine.scheduler.num_preemptions == 0


def test_new_lengths_reuse_compiled_buckets():
    engine = make_engine()
    rng = np.random.default_rng(1)
    # Prompts 17..32 tokens, <= 8 new tokens: every shape lands in the same buckets.
    first = [[int(t) for t in rng.integers(3, 100, size=n)] for n in range(17, 25)]
    engine.generate(first, SamplingParams(temperature=0.0, max_tokens=8))
    before = dict(engine.runner.num_compilations)
    second = [[int(t) for t in rng.integers(3, 100, size=n)] for n in (19, 23, 18, 21, 20)]
    outs = engine.generate(second, SamplingParams(temperature=0.0, max_tokens=7))
    assert dict(engine.runner.num_compilations) == before
    assert outs[3].outputs[0].tokens == naive_greedy(PARAMS, second[3], 7)


def test_group_samples_share_prompt_blocks():
    engine = make_engine(block_size=8)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 100, size=21)]  # 2 full blocks + 5 tokens
    engine.add_request("g", prompt, SamplingParams(n=8, temperature=1.0, max_tokens=20, seed=7))
    kv = engine.kv
    steps = 0
    while engine.has_unfinished:
        finished = engine.step()
        steps += 1
        running = engine.scheduler.running
        if steps == 1:
            assert kv.num_used == 3  # prompt stored once, its partial tail still shared by all 8
        elif running:
            shared = 21 // 8
            # prompt blocks once + each sample's own blocks (its copied tail and new blocks)
            expected = shared + sum(len(s.table.blocks) - shared for s in running)
            assert kv.num_used == expected
            no_sharing = sum(len(s.table.blocks) for s in running)
            assert kv.num_used < no_sharing
            assert all(s.table.blocks[:shared] == running[0].table.blocks[:shared] for s in running)
    (out,) = finished
    assert len({tuple(c.tokens) for c in out.outputs}) > 1, "8 seeded samples should differ"
    assert kv.num_free == engine.config.num_blocks


def test_sampled_logprobs_and_batch_independence():
    rng = np.random.default_rng(3)
    ps = prompts(6, rng)
    params = SamplingParams(n=4, temperature=0.8, max_tokens=10, seed=11)
    alone = make_engine().generate([ps[2]], params)[0]
    batch = make_engine().generate(
        ps,
        [SamplingParams(n=2, temperature=1.2, max_tokens=6, seed=i) for i in range(6)][:2]
        + [params]
        + [SamplingParams(temperature=0.0, max_tokens=9)] * 3,
    )
    together = batch[2]
    assert [c.tokens for c in alone.outputs] == [c.tokens for c in together.outputs]
    for c in together.outputs:
        tf = teacher_forced_logprobs(PARAMS, ps[2], c.tokens, temperature=0.8)
        # float32 rounding of a cached vs a full pass: ~2e-6 relative (1.05e-5 at logprob -4.65)
        np.testing.assert_allclose(c.logprobs, tf, rtol=1e-5, atol=1e-5)


def test_blocks_running_out_preempts_and_still_matches():
    rng = np.random.default_rng(4)
    ps = prompts(16, rng, 10, 30)
    engine = make_engine()  # 96 blocks of 8 tokens; 32 samples need up to 32 * 7
    outs = engine.generate(ps, SamplingParams(n=2, temperature=0.0, max_tokens=24))
    assert engine.scheduler.num_preemptions > 0
    for p, out in zip(ps, outs):
        ref = naive_greedy(PARAMS, p, 24)
        for c in out.outputs:
            assert c.tokens == ref
            # float32 rounding of a cached (preempted, recomputed) vs a full pass, as above:
            # 1.1e-5 at logprob -1.37 once the reference's sums became ordered sums.
            tf = teacher_forced_logprobs(PARAMS, p, c.tokens)
            np.testing.assert_allclose(c.logprobs, tf, rtol=1e-5, atol=1e-5)
    assert engine.num_free_blocks == 96


def test_recompute_shares_the_groups_prompt_blocks_and_matches_an_unpreempted_run():
    """Preempted samples come back on their running siblings' prompt blocks (not rewritten by
    their prefill) and produce what a pool large enough to never preempt produces."""
    rng = np.random.default_rng(5)
    ps = prompts(6, rng, 20, 30)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=7)
    roomy = make_engine(num_blocks=400)
    refs = roomy.generate(ps, params)
    assert roomy.scheduler.num_preemptions == 0
    engine = make_engine(num_blocks=40)  # 24 samples of up to 54 tokens (7 blocks each) in 40 blocks
    outs = engine.generate(ps, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.num_recompute_shared_blocks > 0
    for out, ref in zip(outs, refs, strict=True):
        for c, r in zip(out.outputs, ref.outputs, strict=True):
            assert c.tokens == r.tokens
            np.testing.assert_allclose(c.logprobs, r.logprobs, atol=1e-5)
    assert engine.num_free_blocks == 40


def test_bad_requests_get_errors_and_others_are_served():
    engine = make_engine()
    good = [5, 6, 7, 8]
    outs = engine.generate(
        [good, [5] * 128, [5, 999, 7], [], good],
        SamplingParams(temperature=0.0, max_tokens=4),
    )
    assert "context length is 128" in outs[1].error
    assert "prompt token 999 at index 1 is outside the vocabulary [0, 128)" in outs[2].error
    assert "at least one token" in outs[3].error
    assert outs[0].error is None and outs[4].error is None
    assert outs[0].outputs[0].tokens == outs[4].outputs[0].tokens == naive_greedy(PARAMS, good, 4)
    with pytest.raises(ValueError, match=r"SamplingParams.max_tokens must be an int >= 1, got -3"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("x", good, SamplingParams())
        engine.add_request("x", good, SamplingParams())


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_stop_conditions(num_decode_steps):
    engine = make_engine(eos_token_ids=(), num_decode_steps=num_decode_steps)
    prompt = [5, 9, 17, 33]
    ref = naive_greedy(PARAMS, prompt, 12)
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    out = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_tok,))
    )[0]
    assert out.outputs[0].tokens == ref[: first + 1] and out.outputs[0].finish_reason is FinishReason.EOS
    eos_engine = make_engine(eos_token_ids=(stop_tok,), num_decode_steps=num_decode_steps)
    out = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.outputs[0].tokens == ref[: first + 1]
    out = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert out.outputs[0].tokens == ref and out.outputs[0].finish_reason is FinishReason.LENGTH

    text_engine = LLMEngine(
        CONFIG,
        PARAMS,
        make_engine(num_decode_steps=num_decode_steps).config,
        detokenize=lambda ts: "".join(f"<{t}>" for t in ts),
    )
    stop = f"<{ref[2]}><{ref[3]}>"
    out = text_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,)))[0]
    c = out.outputs[0]
    assert c.finish_reason is FinishReason.STOP and c.stop_string == stop
    assert "".join(f"<{t}>" for t in c.tokens).endswith(stop) and c.tokens == ref[: len(c.tokens)]


def test_abort_frees_blocks_and_keeps_serving():
    engine = make_engine()
    engine.add_request("a", [5, 6, 7], SamplingParams(n=4, temperature=1.0, max_tokens=50))
    engine.add_request("b", [8, 9], SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    engine.step()
    aborted = engine.abort("a")
    assert all(c.finish_reason is FinishReason.ABORT for c in aborted.outputs)
    done = []
    while engine.has_unfinished:
        done += engine.step()
    assert [o.request_id for o in done] == ["b"] and done[0].outputs[0].tokens == naive_greedy(
        PARAMS, [8, 9], 6
    )
    assert engine.num_free_blocks == engine.config.num_blocks


@pytest.mark.parametrize("policy", ["drop", "finish"])
def test_weight_swap_policies(policy):
    import jax

    from rlax_model import init_params

    new = init_params(CONFIG, jax.random.key(1), std=0.25)
    engine = make_engine(swap_policy=policy)
    p1, p2 = [5, 6, 7, 8, 9], [10, 11, 12]
    engine.add_request("old", p1, SamplingParams(temperature=0.0, max_tokens=10))
    for _ in range(3):
        engine.step()
    engine.update_weights(new, 1)
    engine.add_request("new", p2, SamplingParams(temperature=0.0, max_tokens=10))
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o.outputs[0] for o in engine.step()})
    if policy == "drop":
        assert done["old"].weight_version == 1 and done["old"].tokens == naive_greedy(new, p1, 10)
    else:
        assert done["old"].weight_version == 0 and done["old"].tokens == naive_greedy(PARAMS, p1, 10)
    assert done["new"].weight_version == 1 and done["new"].tokens == naive_greedy(new, p2, 10)
    np.testing.assert_allclose(
        done["new"].logprobs, teacher_forced_logprobs(new, p2, done["new"].tokens), atol=1e-5
    )
    with pytest.raises(ValueError, match=r"\['embed'\] is float32\[3, 64\]"):
        engine.update_weights({**new, "embed": new["embed"][:3]}, 2)


# The TPU kernel's interpret mode emulates its DMAs step by step: slow on CPU.
@pytest.mark.parametrize("backend", [pytest.param("pallas_tpu", marks=pytest.mark.slow), "pallas_gpu"])
def test_pallas_decode_path_in_interpret_mode_matches(backend):
    rng = np.random.default_rng(7)
    ps = prompts(3, rng, 3, 20)
    engine = make_engine(attention=backend, attention_interpret=True, max_num_seqs=8)
    outs = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=4))
    for p, out in zip(ps, outs):
        c = out.outputs[0]
        assert c.tokens == naive_greedy(PARAMS, p, 4)
        np.testing.assert_allclose(c.logprobs, teacher_forced_logprobs(PARAMS, p, c.tokens), atol=1e-5)


@pytest.mark.parametrize("num_steps", [1, 4])
def test_xla_decode_path_matches(num_steps):
    """The engine's other CPU path (`attention="xla"`, plain XLA instead of the native kernel)."""
    rng = np.random.default_rng(8)
    ps = prompts(5, rng, 3, 40)
    engine = make_engine(attention="xla", max_num_seqs=8, num_decode_steps=num_steps)
    assert engine.runner.attention == "xla"
    outs = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=6))
    for p, out in zip(ps, outs):
        c = out.outputs[0]
        assert c.tokens == naive_greedy(PARAMS, p, 6)
        np.testing.assert_allclose(c.logprobs, teacher_forced_logprobs(PARAMS, p, c.tokens), atol=1e-5)


# With top logprobs the engine records a call's tokens one by one; without them (and without
# stop strings), in bulk: both must stop where single steps stop.
@pytest.mark.parametrize("num_top", [pytest.param(2, marks=pytest.mark.slow), 0])
def test_multi_step_decoding_equals_single_steps(num_top):
    """Sampled groups, EOS and stop tokens inside a call, top logprobs and preemption: same
    outputs, every block freed."""
    rng = np.random.default_rng(11)
    ps = prompts(10, rng, 4, 30)
    params = SamplingParams(
        n=3, temperature=1.0, max_tokens=29, seed=5, logprobs=num_top, stop_token_ids=(7,)
    )
    results = {}
    for steps, num_blocks in [(1, 300), (8, 300), (8, 40)]:  # 40 blocks: calls fall back and preempt
        engine = make_engine(num_decode_steps=steps, num_blocks=num_blocks, eos_token_ids=(2,))
        results[steps, num_blocks] = engine.generate(ps, params)
        assert engine.num_free_blocks == num_blocks
        if num_blocks == 40:
            assert engine.scheduler.num_preemptions > 0
    single = results[1, 300]
    reasons = {c.finish_reason for o in single for c in o.outputs}
    assert reasons == {FinishReason.EOS, FinishReason.LENGTH}  # some samples stop inside a call
    stops = {2, 7}  # EOS and the stop token
    for c in (c for out in results.values() for o in out for c in o.outputs):
        assert not stops & set(c.tokens[:-1]), "generation went on past a stop"
        if c.finish_reason is FinishReason.EOS:
            assert c.tokens[-1] in stops
        else:
            assert len(c.tokens) == 29
    assert any(c.tokens[-1] == 7 for o in single for c in o.outputs), "the stop token never came up"
    for key in [(8, 300), (8, 40)]:
        for a, b in zip(single, results[key], strict=True):
            for ca, cb in zip(a.outputs, b.outputs, strict=True):
                assert ca.tokens == cb.tokens and ca.finish_reason is cb.finish_reason
                # Another program (a loop of steps) rounds differently, within the engine's 1e-5.
                np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-5)
                assert [[t for t, _ in top] for top in ca.top_logprobs] == [
                    [t for t, _ in top] for top in cb.top_logprobs
                ]


def test_multi_step_programs_compile_once_after_warmup():
    engine = make_engine(num_decode_steps=4, max_num_seqs=16)
    engine.runner.warmup(16, num_steps=(1, 4))
    rng = np.random.default_rng(12)
    engine.generate(prompts(4, rng, 5, 20), SamplingParams(n=4, temperature=1.0, max_tokens=23, seed=1))
    before = dict(engine.runner.num_compilations)
    engine.generate(prompts(4, rng, 5, 20), SamplingParams(n=4, temperature=1.0, max_tokens=37, seed=2))
    assert dict(engine.runner.num_compilations) == before


WINDOWED = dataclasses.replace(CONFIG, sliding_window=6)  # Mistral-style, far shorter than the prompts


@pytest.mark.parametrize(
    "attention,num_steps",
    [
        ("cpu", 1),
        ("cpu", 4),
        ("xla", 3),
        ("pallas_gpu", 1),
        pytest.param("pallas_tpu", 1, marks=pytest.mark.slow),
    ],
)
def test_sliding_window_model_generates_what_forward_generates(attention, num_steps):
    """Prefill and decode see only the window, as `forward` does for such a config, on every decode path."""
    rng = np.random.default_rng(12)
    ps = prompts(4 if attention in ("cpu", "xla") else 2, rng, 8, 30)
    engine = LLMEngine(WINDOWED, PARAMS, EngineConfig(
        block_size=8, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=128,
        eos_token_ids=(), attention=attention, attention_interpret=attention.startswith("pallas"),
        num_decode_steps=num_steps,
    ))  # fmt: skip
    outs = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=10))
    differs = False
    for p, out in zip(ps, outs, strict=True):
        c = out.outputs[0]
        assert c.tokens == naive_greedy(PARAMS, p, 10, config=WINDOWED)
        np.testing.assert_allclose(
            c.logprobs, teacher_forced_logprobs(PARAMS, p, c.tokens, config=WINDOWED), atol=1e-5
        )
        differs |= c.tokens != naive_greedy(PARAMS, p, 10)
    assert differs, "the window changes no token here: the test would not notice it being ignored"
