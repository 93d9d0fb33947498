"""After `compile_all_shapes`, no path of the engine compiles: preemption and recompute,
copy-on-write, prefix-cache hits, chunked prefill, prefill folded into decode calls,
samples finishing at different times, filtered sampling and top log-probs all run on
programs compiled before serving."""

import numpy as np
import pytest
from tiny_model import CONFIG, PARAMS, naive_greedy

from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.sequence import SamplingParams
from rlax_inference.warm_up import compile_all_shapes

# Small bounds keep the set of programs small: 16 rows, 64 tokens, chunks of at most 24 tokens.
ENGINE = EngineConfig(
    block_size=8,
    num_blocks=40,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    prefill_chunk_size=24,
    max_model_len=64,
    max_prefill_rows=8,
    eos_token_ids=(),
    num_decode_steps=2,
    fold_prefill="on",
)
SAMPLED = SamplingParams(n=3, temperature=0.9, top_p=0.8, max_tokens=20, logprobs=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


# Compiling the whole bounded set takes ~70 s of the 2-core machine's CPU: `nox -s slow`.
@pytest.mark.slow
def test_no_path_compiles_after_compile_all_shapes():
    engine = LLMEngine(CONFIG, PARAMS, ENGINE)
    compile_all_shapes(engine, [SAMPLED, GREEDY])
    compiled = dict(engine.runner.num_compilations)
    assert set(compiled) == {"copy", "decode", "mixed", "prefill", "sample"}

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, CONFIG.vocab_size, size=n)] for n in (5, 11, 30, 19, 9, 27)]
    # Partly filled last prompt blocks and n = 3: copy-on-write; 6 x 3 samples of up to 50
    # tokens in a 40-block pool: preemption and recompute; 30-token prompts: chunked prefill.
    outs = engine.generate(prompts, SAMPLED)
    assert engine.kv.num_cow_copies > 0
    assert engine.scheduler.num_preemptions > 0
    assert all(o.error is None for o in outs)
    # The same prompts again, greedy and with different lengths: prefix-cache hits, and
    # prefills that start after cached blocks.
    hits_before = engine.num_prefix_cache_hit_tokens
    again = engine.generate([p + [7] * k for k, p in enumerate(prompts)], GREEDY)
    assert engine.num_prefix_cache_hit_tokens > hits_before
    for k, (p, out) in enumerate(zip(prompts, again)):
        assert out.outputs[0].tokens == naive_greedy(PARAMS, p + [7] * k, 12)
    # Requests of different lengths in one batch: the decode batch shrinks through its buckets.
    engine.generate(prompts[:5], SamplingParams(n=2, temperature=1.0, max_tokens=3, logprobs=1))
    engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 4, 9, 16, 25, 33)])
    # Prefill of recomputes and of chunks after the first rode in decode calls (`fold_prefill`).
    assert engine.num_mixed_calls > 0
    assert dict(engine.runner.num_compilations) == compiled
