"""Keeping a partial rollout's stale K/V across new weights (`EngineConfig.keep_stale_kv`,
`workers.resume_kv: keep`, PipelineRL's choice): new weights start new key chains instead of
dropping the cache; only a request that accepts stale K/V (a resumed sample) finds the old
chains, and what it computes from them stays in them, out of every fresh request's reach."""

from __future__ import annotations

import numpy as np
from test_prefix_cache import make_engine
from tiny_model import CONFIG, PARAMS, teacher_forced_logprobs

from rlax_inference.block_pool import KVCacheManager
from rlax_inference.engine import LLMEngine
from rlax_inference.engine_outputs import RequestOutput
from rlax_inference.sequence import SamplingParams

NEW_PARAMS = {**PARAMS, "embed": PARAMS["embed"] * 1.5}  # every layer's K/V move with it
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def run(engine: LLMEngine, request_id: str, tokens: list[int], *, reuse_stale_kv: bool) -> RequestOutput:
    engine.add_request(request_id, tokens, GREEDY, reuse_stale_kv=reuse_stale_kv)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        done.update((out.request_id, out) for out in engine.step())
    return done[request_id]


def first_segment(engine: LLMEngine) -> list[int]:
    """A 30-token prompt and the 3 tokens the old weights drew for it (32 of them computed:
    4 full blocks of 8 stay keyed)."""
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, CONFIG.vocab_size, size=30)]
    [out] = engine.generate([prompt], GREEDY)
    return prompt + out.outputs[0].tokens


def test_a_resumed_request_continues_from_the_old_weights_kv_and_a_fresh_one_never_sees_it():
    engine = make_engine(keep_stale_kv=True)
    tokens = first_segment(engine)
    engine.update_weights(NEW_PARAMS, 1)
    assert engine.kv.pool.num_cached == 4  # kept, in the old weights' chain
    resumed = run(engine, "resumed", tokens, reuse_stale_kv=True)
    assert resumed.num_cached_tokens == 32  # all but the last token: nothing prefilled again
    fresh = run(engine, "fresh", tokens, reuse_stale_kv=False)
    assert fresh.num_cached_tokens == 0  # neither the stale blocks nor what `resumed` computed on them
    again = run(engine, "again", tokens, reuse_stale_kv=False)
    assert again.num_cached_tokens == 32  # `fresh`'s blocks: the new weights' own
    exact = teacher_forced_logprobs(NEW_PARAMS, tokens, fresh.outputs[0].tokens)
    np.testing.assert_allclose(fresh.outputs[0].logprobs, exact, atol=1e-5)
    np.testing.assert_allclose(again.outputs[0].logprobs, exact, atol=1e-5)
    # The resumed sample's new tokens attended to stale K/V: its log-probs are not the new
    # weights' alone (the weights moved, so a test of this kind can see the difference).
    stale = np.asarray(resumed.outputs[0].logprobs)
    recomputed = teacher_forced_logprobs(NEW_PARAMS, tokens, resumed.outputs[0].tokens)
    assert np.max(np.abs(stale - recomputed)) > 1e-3
    assert resumed.outputs[0].weight_version == 1


def test_without_keep_stale_kv_new_weights_drop_the_cache_whatever_a_request_accepts():
    engine = make_engine()  # keep_stale_kv=False: the default
    tokens = first_segment(engine)
    engine.update_weights(NEW_PARAMS, 1)
    assert engine.kv.pool.num_cached == 0
    resumed = run(engine, "resumed", tokens, reuse_stale_kv=True)
    assert resumed.num_cached_tokens == 0
    exact = teacher_forced_logprobs(NEW_PARAMS, tokens, resumed.outputs[0].tokens)
    np.testing.assert_allclose(resumed.outputs[0].logprobs, exact, atol=1e-5)


def test_a_stale_chain_is_searched_only_when_asked_and_the_longest_hit_wins() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(13))
    table = kv.allocate(13)
    kv.cache_full_blocks(table, tokens, 12)  # 3 full blocks under the first weights' root
    old_blocks = list(table.blocks[:3])
    kv.free(table)
    kv.new_weights(keep=True)
    assert kv.prefix_hit(tokens).blocks == []
    stale = kv.prefix_hit(tokens, stale_ok=True)
    assert stale.blocks == old_blocks and stale.root == kv.stale_roots[0] != kv.root
    # The new weights compute the first block: a stale-accepting request still prefers the
    # longer stale chain; once the new chain is as long, the new weights' blocks win.
    fresh = kv.allocate(13)
    kv.cache_full_blocks(fresh, tokens, 4)
    assert kv.prefix_hit(tokens, stale_ok=True).blocks == old_blocks
    kv.cache_full_blocks(fresh, tokens, 12)
    newest = kv.prefix_hit(tokens, stale_ok=True)
    assert newest.blocks == fresh.blocks[:3] and newest.root == kv.root
    kv.new_weights(keep=False)  # a run without keep: everything goes
    assert kv.prefix_hit(tokens, stale_ok=True).blocks == [] and not kv.stale_roots
