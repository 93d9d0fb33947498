"""Prefix caching to the token: a finished sequence's partly filled last block is reused by a
sequence that continues it (the next turn of a trajectory), copy-on-write (issue 32).

Block-pool tests use hand-picked tokens; scheduler tests run the paged fake runner
(`inference_fakes`), which stores each token id in its slot and asserts that every reused slot
holds the very token the new sequence would have written; engine tests compare a continued
trajectory with the same requests on an engine without prefix caching, on the tiny model.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from inference_fakes import check_unaborted_outputs, expected, run_to_completion
from test_prefix_cache import make_engine as prefix_cache_engine
from test_scheduler import make
from tiny_model import CONFIG, PARAMS, teacher_forced_logprobs

from rlax_inference.block_pool import ROOT_KEY, BlockPool, KVCacheManager, PrefixHit, block_keys
from rlax_inference.sequence import Request, SamplingParams

BS = 4
# 11 tokens; a finished sequence computed the first 10: 2 full blocks + [108, 109] in a third.
TOKENS = list(range(100, 111))


def finished_sequence(kv: KVCacheManager) -> list[int]:
    """Allocate TOKENS' table, key its computed blocks as `Scheduler.finish` does, free it."""
    table = kv.allocate(len(TOKENS))
    assert kv.cache_computed_blocks(table, TOKENS, len(TOKENS) - 1) == 3  # 2 full keys + 1 partial
    blocks = list(table.blocks)
    kv.free(table)
    return blocks


def all_refcounts_zero(pool: BlockPool) -> bool:
    return all(pool.refcount(b) == 0 for b in range(1, pool.num_blocks + 1)) and pool.num_used == 0


# -- the block pool -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "full", "partial_tokens"),
    [
        (TOKENS[:10] + [7, 7], 2, 2),  # continues exactly the computed tokens: all 10 cached
        (TOKENS + [1, 2, 3], 2, 2),  # continues further (the last sample too): the block's 2 tokens
        (TOKENS[:9] + [55, 56], 2, 1),  # shares 1 of the block's 2 tokens: takes that one
        (TOKENS[:8] + [108, 5], 2, 1),  # the same, diverging right after it
        (TOKENS[:8] + [99, 108, 109], 2, 0),  # diverges at the block's first token: full blocks only
        (TOKENS[:10], 2, 1),  # ends inside the block: its last token is always computed
        (TOKENS[:4] + [9] * 8, 1, 0),  # diverges in a full block: full blocks are matched whole
    ],
)
def test_prefix_hit_takes_the_longest_cached_prefix_to_the_token(prompt, full, partial_tokens):
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    blocks = finished_sequence(kv)
    hit = kv.prefix_hit(prompt)
    assert hit.blocks == blocks[:full]
    assert hit.partial_tokens == partial_tokens
    assert hit.partial_block == (blocks[2] if partial_tokens else None)
    assert hit.num_tokens(BS) == full * BS + partial_tokens < len(prompt)
    assert kv.cached_prefix(prompt) == blocks[:full]  # the full-block view is unchanged


def test_taking_a_partial_block_copies_it_and_refcounts_return_to_zero():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    blocks = finished_sequence(kv)
    prompt = TOKENS[:10] + [7, 7, 7]  # 13 tokens: 4 blocks, 2 shared, 2 fresh
    hit = kv.prefix_hit(prompt)
    # The held partial block is unreferenced (it counts as free), so allocating holds one more.
    assert kv.blocks_to_allocate_hit(len(prompt), hit) == kv.blocks_to_allocate(len(prompt), hit.blocks) + 1
    allocation = kv.allocate_hit(len(prompt), hit)
    table = allocation.table
    assert table.blocks[:2] == blocks[:2] and blocks[2] not in table.blocks
    # The new sequence writes tokens 10.. into its own block, after a copy of the cached one.
    assert allocation.copy == (blocks[2], table.blocks[2])
    assert [kv.pool.refcount(b) for b in blocks] == [1, 1, 0]
    assert kv.pool.is_evictable(blocks[2]) and kv.num_partial_copies == 1
    # The cached block still answers the same continuation while the copy is in use.
    assert kv.prefix_hit(prompt).partial_block == blocks[2]
    kv.free(table)
    assert all_refcounts_zero(kv.pool) and kv.num_free == 8
    with pytest.raises(ValueError, match="leaves none"):
        kv.allocate_hit(10, PrefixHit(blocks[:2], blocks[2], 2))


def test_partial_blocks_are_evicted_least_recently_used_and_their_keys_dropped():
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    blocks = finished_sequence(kv)  # all 3 blocks cached, unreferenced
    assert kv.pool.num_cached == 3 and kv.pool.num_cached_partial == 1 and kv.num_free == 3
    # LRU order is the order they were freed: the two full blocks go first, then the partial one.
    assert [kv.pool.allocate() for _ in range(3)] == blocks
    assert kv.pool.num_cached == 0 and kv.pool.num_evictions == 3
    assert kv.pool.longest_partial(block_keys(TOKENS, BS, 2)[-1], [108, 109]) == (None, 0)
    assert kv.pool._partial_children == {}  # the scan index forgot it too
    for b in blocks:
        kv.pool.decref(b)
    assert all_refcounts_zero(kv.pool)


def test_reset_prefix_cache_drops_partial_keys():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    finished_sequence(kv)
    assert kv.pool.reset_prefix_cache() == 3
    assert kv.pool.num_cached_partial == 0 and kv.prefix_hit(TOKENS + [1]) == PrefixHit()
    assert all_refcounts_zero(kv.pool) and kv.num_free == 16


def test_a_partial_key_grows_with_its_block_and_becomes_full():
    pool = BlockPool(4, BS)
    block = pool.allocate()
    assert pool.set_partial_key(block, ROOT_KEY, [5])
    assert not pool.set_partial_key(block, ROOT_KEY, [5])  # the same key again: nothing changes
    assert pool.set_partial_key(block, ROOT_KEY, [5, 6, 7])  # its holder wrote on: the longer key
    assert pool.longest_partial(ROOT_KEY, [5, 6, 9]) == (block, 2)
    assert not pool.set_partial_key(block, ROOT_KEY, [5, 6])  # never a shorter one
    other = pool.allocate()
    assert not pool.set_partial_key(other, ROOT_KEY, [5, 6, 7])  # one block per key
    [key] = block_keys([5, 6, 7, 8], BS, 1)
    assert pool.set_key(block, key)  # filled: the full key replaces the partial one
    assert pool.num_cached_partial == 0 and pool.cached_block(key) == block
    assert pool.longest_partial(ROOT_KEY, [5, 6, 7]) == (None, 0)
    assert not pool.set_partial_key(block, ROOT_KEY, [5])  # a full block is never keyed as partial
    with pytest.raises(ValueError, match="1..3 tokens"):
        pool.set_partial_key(other, ROOT_KEY, [1, 2, 3, 4])


def test_partial_blocks_off_keeps_whole_block_caching():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True, enable_partial_blocks=False)
    table = kv.allocate(len(TOKENS))
    assert kv.cache_computed_blocks(table, TOKENS, len(TOKENS) - 1) == 2
    kv.free(table)
    hit = kv.prefix_hit(TOKENS + [1])
    assert hit.partial_block is None and hit.num_tokens(BS) == 8


# -- the scheduler, on the paged fake runner -----------------------------------------------
def continuation(i: int, done: Request, sample: int, extra: list[int], max_tokens: int = 5) -> Request:
    tokens = done.sequences[sample].tokens + extra
    return Request(f"c{i}", tokens, SamplingParams(max_tokens=max_tokens), arrival=100 + i)


def test_a_continued_sequence_computes_only_its_new_tokens_and_copies_the_partial_block():
    sched, runner = make(num_blocks=32, block_size=BS, prefix_caching=True, watermark=0.0)
    first = Request("t0", list(range(10, 17)), SamplingParams(n=2, max_tokens=6), arrival=0)
    sched.add(first)
    run_to_completion(runner)
    # 7 + 6 tokens per sample, 12 computed: 3 full blocks and no partial one.
    second = continuation(0, first, 1, [40, 41, 42, 43, 44])  # 13 + 5 = 18 tokens
    sched.add(second)
    out = runner.step()
    [job] = out.prefills
    assert job.num_shared_tokens == 12 and job.chunk == second.prompt[12:]  # the last sample + 5
    assert sched.num_prefix_cache_partial_hit_tokens == 0  # 12 is a multiple of the block size
    run_to_completion(runner)
    # 18 + 5 tokens, 22 computed: 5 full blocks and 2 tokens of a sixth.
    third = continuation(1, second, 0, [45, 46])
    sched.add(third)
    out = runner.step()
    [job] = out.prefills
    assert job.num_shared_tokens == 22 and len(job.chunk) == 3
    assert sched.num_prefix_cache_partial_hit_tokens == 2 and len(out.copies) == 1
    src, dst = out.copies[0]
    assert src not in job.table.blocks and dst == job.table.blocks[5]
    run_to_completion(runner)
    for r in (first, second, third):
        assert [s.output_tokens for s in r.sequences] == expected(r, 48)
        assert r.num_cached_tokens == {"t0": 0, "c0": 12, "c1": 22}[r.request_id]
    assert sched.kv.num_used == 0


def test_two_divergent_continuations_of_one_partial_block_leave_the_cached_copy_intact():
    sched, runner = make(num_blocks=40, block_size=BS, prefix_caching=True, watermark=0.0)
    first = Request("t0", list(range(10, 19)), SamplingParams(max_tokens=2), arrival=0)
    sched.add(first)
    run_to_completion(runner)  # 11 tokens, 10 computed: 2 full blocks + 2 tokens
    cached = sched.kv.prefix_hit(first.sequences[0].tokens + [1]).partial_block
    a = continuation(0, first, 0, [30, 31, 32], max_tokens=7)  # takes both tokens
    b = Request("c1", first.prompt[:9] + [33, 34], SamplingParams(max_tokens=7), arrival=101)  # only 1
    sched.add(a)
    sched.add(b)
    out = runner.step()  # both admitted in one step: two copies of the same cached block
    assert sorted(j.num_shared_tokens for j in out.prefills) == [9, 10]
    assert [src for src, _ in out.copies] == [cached, cached]
    run_to_completion(runner)
    # The fake checked that every reused slot held the right token; the cached block still does.
    again = continuation(2, first, 0, [35], max_tokens=3)
    sched.add(again)
    out = runner.step()
    assert out.prefills[0].num_shared_tokens == 10 and out.copies[0][0] == cached
    run_to_completion(runner)
    for r in (first, a, b, again):
        assert [s.output_tokens for s in r.sequences] == expected(r, 48)
    assert sched.kv.num_used == 0


@pytest.mark.parametrize("chunk", [None, 3])
def test_random_multi_turn_continuations_under_pool_pressure_match_the_reference(chunk):
    """As an agent loop does: a finished sample is continued at once, exactly or sharing a few
    tokens less, beside fresh requests, in a pool small enough to evict and preempt. The fake
    checks every reused slot; every output is checked against the reference."""
    rng = random.Random(11)
    sched, runner = make(
        num_blocks=32, block_size=BS, max_num_seqs=8, max_num_batched_tokens=40, prefix_caching=True,
        chunked_prefill=True, prefill_chunk_size=chunk, max_model_len=60,
    )  # fmt: skip
    live: list[Request] = []
    done: list[Request] = []
    count = 0

    def add(prompt: list[int], n: int) -> None:
        nonlocal count
        r = Request(f"r{count}", prompt, SamplingParams(n=n, max_tokens=rng.randrange(1, 12)), arrival=count)
        count += 1
        sched.add(r)
        live.append(r)

    for _ in range(600):
        if len(sched.waiting) < 3 and rng.random() < 0.5:
            add([rng.randrange(50) for _ in range(rng.randrange(1, 12))], rng.choice([1, 2, 3]))
        runner.step()
        for r in [r for r in live if r.finished]:
            live.remove(r)
            done.append(r)
            for s in r.sequences:
                if len(s.tokens) < 44 and len(sched.waiting) < 3 and rng.random() < 0.6:
                    cut = len(s.tokens) - rng.choice([0, 0, 0, 1, 2, 3])  # exact, or sharing less
                    add(
                        s.tokens[:cut] + [rng.randrange(50) for _ in range(rng.randrange(1, 6))],
                        rng.choice([1, 1, 2]),
                    )
    run_to_completion(runner)
    done += live
    assert sched.num_prefix_cache_partial_hit_tokens > 100 and sched.kv.num_partial_copies > 50
    assert sched.kv.pool.num_evictions > 0 and sched.num_preemptions > 0
    assert check_unaborted_outputs(done, 60) == len(done) > 300
    assert all_refcounts_zero(sched.kv.pool) and sched.kv.num_free == 32


# -- the engine on the tiny model -------------------------------------------------------------
def make_engine(**kw):  # type: ignore[no-untyped-def]
    return prefix_cache_engine(**{"num_blocks": 64, **kw})


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, CONFIG.vocab_size, size=n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_continued_trajectory_equals_a_cold_run_and_prefills_only_its_new_tokens(temperature):
    """Three turns, 2 samples: each later turn takes the earlier turn's partly filled last block
    from the cache and computes only the last sampled token and the observation."""
    prompt, observations = _tokens(1, 11), (_tokens(2, 3), _tokens(3, 2))
    warm, cold = make_engine(), make_engine(enable_prefix_caching=False)
    outs = {}
    for name, engine in (("warm", warm), ("cold", cold)):
        params = SamplingParams(n=2, temperature=temperature, max_tokens=6, seed=5)
        [first] = engine.generate([prompt], params)
        trajectories = [prompt + c.tokens for c in first.outputs]
        turns = [first]
        for turn, observation in enumerate(observations, start=1):
            prompts = [t + observation for t in trajectories]
            before = engine.num_computed_prefill_tokens
            later = engine.generate(
                prompts,
                [SamplingParams(temperature=temperature, max_tokens=6, seed=10 * turn + i) for i in range(2)],
            )
            if name == "warm":
                # Computed: the last sampled token of each trajectory (never fed) and the observation.
                assert engine.num_computed_prefill_tokens - before == 2 * (1 + len(observation))
                assert [o.num_cached_tokens for o in later] == [
                    len(p) - 1 - len(observation) for p in prompts
                ]
            trajectories = [p + o.outputs[0].tokens for p, o in zip(prompts, later, strict=True)]
            turns += later
        outs[name] = (trajectories, turns)
    stats = warm.prefix_cache_stats()
    # 11 + 6 = 17 tokens, 16 computed (full); then 20 + 6, 25 computed: 3 full blocks + 1 token.
    assert stats["prefix_cache_partial_hit_tokens"] == 2 * 1 and stats["partial_block_copies"] == 2
    assert cold.num_prefix_cache_hit_tokens == 0
    assert outs["warm"][0] == outs["cold"][0]
    for w, c in zip(outs["warm"][1], outs["cold"][1], strict=True):
        for wc, cc in zip(w.outputs, c.outputs, strict=True):
            assert wc.tokens == cc.tokens
            np.testing.assert_allclose(wc.logprobs, cc.logprobs, rtol=0, atol=1e-5)
    trajectories, turns = outs["warm"]
    for trajectory, last_turn in zip(trajectories, turns[-2:], strict=True):
        if temperature:  # the last turn's log-probs, against one cache-free pass over the trajectory
            reference = teacher_forced_logprobs(PARAMS, trajectory[:-6], trajectory[-6:])
            np.testing.assert_allclose(last_turn.outputs[0].logprobs, reference, atol=1e-5)
    assert warm.num_free_blocks == 64


def test_a_shorter_shared_prefix_takes_part_of_the_block_and_the_cached_copy_survives():
    """A request sharing only part of a cached partial block overwrites its copy from there on;
    the cached block still serves the exact continuation afterwards, and both equal cold runs."""
    prompt = _tokens(4, 13)
    greedy = SamplingParams(temperature=0.0, max_tokens=7)
    warm, cold = make_engine(), make_engine(enable_prefix_caching=False)
    [first] = warm.generate([prompt], greedy)  # 20 tokens, 19 computed: 2 full blocks + 3 tokens
    tokens = prompt + first.outputs[0].tokens
    diverging = tokens[:17] + _tokens(5, 4)  # shares 1 of the partial block's 3 tokens
    continuing = tokens + _tokens(6, 2)
    for request in (diverging, continuing):
        [hit] = warm.generate([request], greedy)
        [ref] = cold.generate([request], greedy)
        assert hit.outputs[0].tokens == ref.outputs[0].tokens
        np.testing.assert_allclose(hit.outputs[0].logprobs, ref.outputs[0].logprobs, rtol=0, atol=1e-5)
        assert hit.num_cached_tokens == (17 if request is diverging else 19)
    assert warm.prefix_cache_stats()["partial_block_copies"] == 2
