"""Automatic prefix caching: keyed full blocks, reuse by later requests, LRU eviction, invalidation.

The scheduler-level tests run the paged fake runner (`inference_fakes`), which stores each
token id in its slot and checks that every reused slot holds the very token the new request
would have written there; the engine-level tests compare a request that hits the cache with
the same request run cold, on the tiny model.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from inference_fakes import check_unaborted_outputs, expected, run_to_completion
from test_scheduler import make
from tiny_model import CONFIG, PARAMS, teacher_forced_logprobs

from rlax_inference.block_pool import BlockPool, KVCacheManager, block_keys
from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.sequence import Request, SamplingParams


def test_keys_name_the_whole_prefix():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = block_keys([1, 2, 3, 9, 5, 6, 7, 8], 4, 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parents
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2) == a


def test_unreferenced_cached_blocks_are_free_and_evicted_least_recently_used_first():
    pool = BlockPool(3, 4)
    blocks = [pool.allocate() for _ in range(3)]
    for key, block in enumerate(blocks):
        assert pool.set_key(block, 100 + key)
    for block in (blocks[1], blocks[0], blocks[2]):  # released in this order: LRU is blocks[1]
        pool.decref(block)
    assert pool.num_free == 3 and pool.num_used == 0 and pool.num_cached == 3
    pool.share(blocks[0])  # a hit revives blocks[0]: no longer evictable
    assert pool.num_free == 2 and pool.refcount(blocks[0]) == 1
    assert pool.allocate() == blocks[1] and pool.cached_block(101) is None
    assert pool.allocate() == blocks[2] and pool.num_evictions == 2
    assert pool.cached_block(100) == blocks[0]
    pool.decref(blocks[0])
    assert pool.reset_prefix_cache() == 1
    assert pool.cached_block(100) is None and pool.num_free == 1
    with pytest.raises(ValueError, match="is free"):
        pool.share(blocks[0])


def test_manager_finds_the_longest_cached_prefix_but_always_leaves_a_token_to_compute():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(12))
    table = kv.allocate(12)
    assert kv.cache_full_blocks(table, tokens, 12) == 3
    blocks = list(table.blocks)
    kv.free(table)
    hits = kv.cached_prefix(tokens)
    assert hits == blocks[:2]  # (12 - 1) // 4: the last block is recomputed for its logits
    assert len(kv.cached_prefix(tokens + [99])) == 3
    assert kv.cached_prefix([0, 1, 2, 3, 7, 7, 7, 7, 1]) == hits[:1]
    assert kv.blocks_to_allocate(13, hits) == 4 - 2 + 2  # two fresh blocks, two revived from the LRU list
    assert KVCacheManager(16, 4).cached_prefix(tokens + [99]) == []  # caching off


def shared_prefix_request(i, rng, prefixes, max_tokens=8, n=1):
    prefix = rng.choice(prefixes)
    prompt = prefix[: rng.randrange(1, len(prefix) + 1)] + [
        rng.randrange(50) for _ in range(rng.randrange(0, 6))
    ]
    return Request(f"r{i}", prompt, SamplingParams(n=n, max_tokens=max_tokens), arrival=i)


@pytest.mark.parametrize("chunk", [None, 5])
def test_random_requests_with_shared_prefixes_reuse_blocks_and_match_the_reference(chunk):
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(28)] for _ in range(4)]
    sched, runner = make(
        num_blocks=40, block_size=4, max_num_seqs=16, max_num_batched_tokens=40, prefix_caching=True,
        chunked_prefill=True, prefill_chunk_size=chunk,
    )  # fmt: skip
    live, done = [], []
    for i in range(400):
        r = shared_prefix_request(
            i, rng, prefixes, max_tokens=rng.randrange(1, 14), n=rng.choice([1, 1, 2, 4])
        )
        sched.add(r)
        live.append(r)
        if rng.random() < 0.4:
            runner.step()
        if rng.random() < 0.05:
            sched.abort(rng.choice(live).request_id)
        for r in [r for r in live if r.finished]:
            live.remove(r)
            done.append(r)
    run_to_completion(runner)
    done += live
    assert sched.kv.num_used == 0 and sched.kv.num_free == 40  # cached blocks count as free
    assert sched.num_prefix_cache_hit_blocks > 100  # the fake checked every reused slot's token
    assert runner.shared_tokens_read >= sched.num_prefix_cache_hit_tokens
    assert sched.kv.pool.num_evictions > 0 and sched.num_preemptions > 0
    assert check_unaborted_outputs(done, 48) > 300


def test_prompt_longer_than_a_chunk_is_prefilled_over_several_steps():
    sched, runner = make(
        num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=4, chunked_prefill=True,
        prefill_chunk_size=5,
    )  # fmt: skip
    r = Request("long", list(range(40, 40 + 23)), SamplingParams(n=2, max_tokens=3), arrival=0)
    sched.add(r)
    chunks = []
    while not r.sequences[0].num_generated:
        out = runner.step()
        chunks += [(j.chunk_start, j.chunk_end) for j in out.prefills]
    assert chunks == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    run_to_completion(runner)
    assert [s.output_tokens for s in r.sequences] == expected(r, 48)


# -- the engine on the tiny model -------------------------------------------------------
def make_engine(**kw):  # type: ignore[no-untyped-def]
    cfg = dict(
        block_size=8, num_blocks=48, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
        eos_token_ids=(),
    )  # fmt: skip
    cfg.update(kw)
    return LLMEngine(CONFIG, PARAMS, EngineConfig(**cfg))


def _prompt(rng, n):
    return [int(t) for t in rng.integers(3, CONFIG.vocab_size, size=n)]


def test_second_request_hits_the_cache_and_equals_a_cold_run():
    rng = np.random.default_rng(5)
    prefix = _prompt(rng, 35)
    first, second = prefix + _prompt(rng, 4), prefix + _prompt(rng, 6)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=3)
    warm = make_engine()
    warm.generate([first], params)
    before = warm.prefix_cache_stats()
    [hit] = warm.generate([second], params)
    stats = warm.prefix_cache_stats()
    # 35 shared tokens = 4 full blocks of 8; the second prompt computes only its other 9 tokens.
    assert stats["prefix_cache_hit_blocks"] - before["prefix_cache_hit_blocks"] == 4
    assert stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 32
    assert stats["computed_prefill_tokens"] - before["computed_prefill_tokens"] == len(second) - 32
    assert warm.num_prefix_cache_hit_tokens == 32
    cold_engine = make_engine(enable_prefix_caching=False)
    [cold] = cold_engine.generate([second], params)
    assert cold_engine.num_prefix_cache_hit_tokens == 0
    for h, c in zip(hit.outputs, cold.outputs, strict=True):
        assert h.tokens == c.tokens
        np.testing.assert_allclose(h.logprobs, c.logprobs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(h.logprobs, teacher_forced_logprobs(PARAMS, second, h.tokens), atol=1e-5)


def test_weight_update_invalidates_the_prefix_cache():
    rng = np.random.default_rng(6)
    prompt = _prompt(rng, 30)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    engine = make_engine()
    engine.generate([prompt], params)
    # 30 prompt + 3 generated tokens, 32 of them computed (not the last sample): 4 full blocks.
    assert engine.kv.pool.num_cached == 4
    new = {**PARAMS, "embed": PARAMS["embed"] * 1.5}
    engine.update_weights(new, 1)
    assert engine.kv.pool.num_cached == 0
    [out] = engine.generate([prompt], params)
    assert engine.num_prefix_cache_hit_tokens == 0  # nothing computed by the old weights was reused
    c = out.outputs[0]
    assert c.weight_version == 1
    np.testing.assert_allclose(c.logprobs, teacher_forced_logprobs(new, prompt, c.tokens), atol=1e-5)
    engine.generate([prompt], params)  # the new weights' blocks are cached again
    assert engine.num_prefix_cache_hit_tokens == 24


def test_pool_pressure_evicts_cached_blocks_and_outputs_stay_right():
    rng = np.random.default_rng(9)
    engine = make_engine(num_blocks=12, watermark=0.0)
    prompts = [_prompt(rng, 40) for _ in range(3)]  # 5 blocks each, + tails: only one fits cached at a time
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outs = [engine.generate([p], params)[0] for p in prompts]
    assert engine.kv.pool.num_evictions > 0
    again = engine.generate([prompts[-1]], params)[0]  # the newest prompt's blocks survived
    assert engine.num_prefix_cache_hit_tokens == 32
    for p, o in zip(prompts + [prompts[-1]], outs + [again], strict=True):
        c = o.outputs[0]
        np.testing.assert_allclose(c.logprobs, teacher_forced_logprobs(PARAMS, p, c.tokens), atol=1e-5)
    assert engine.num_free_blocks == 12
