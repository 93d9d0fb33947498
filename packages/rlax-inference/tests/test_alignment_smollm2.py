"""Training-inference alignment and the dtype policy that engine and trainer share.

slow: on SmolLM2-135M-Instruct in float32, the trainer's recompute (`rlax_model.logprobs`
over right-padded rows, as `rlax_trainer.learner` calls it) of >= 512 tokens the engine
sampled agrees with the engine's behaviour log-probs to p95 <= 2e-5. Issue 13 asks
p95 <= 1e-5, which is NOT met: measured 1.4-1.5e-5 (the issue's "before" was 1.7e-5). The
prefill's tokens agree to the bit at trainer widths that are multiples of 64; the rest is
the decode kernel's page-by-page online softmax summing in another order than the dense
attention, through 30 layers.
`benchmarks/bench_alignment.py` reports the same figures for float32 and bfloat16.

fast: bfloat16 requested on the CPU computes in float32 on both sides of a run (the
standalone worker's engine and the trainer's learner), with one log line; the opt-out
(`RLAX_BF16_ON_CPU=1`) keeps bfloat16 on both sides.
"""

import dataclasses
import logging
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import teacher_forced_logprobs

import rlax_protocol as rp
from rlax_core.tokenizer import Tokenizer
from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_inference.worker_process import Worker, WorkerConfig
from rlax_model import (
    BF16_ON_CPU_ENV,
    DenseContext,
    ModelConfig,
    find_smollm2_gguf,
    init_params,
    load_gguf,
    logprobs,
)
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server

ROOT = pathlib.Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- the float32 bound (slow)
def _trainer_bucket(n: int) -> int:
    """`rlax_trainer.padding.bucketed_length`: 16, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, ..."""
    if n <= 16:
        return 16
    step = max((1 << (n - 1).bit_length()) // 8, 1)
    return -(-n // step) * step


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_float32_same_version_logprobs_agree_to_2e_5():
    config, params = load_gguf(find_smollm2_gguf())
    tok = Tokenizer.from_gguf(find_smollm2_gguf())
    questions = ["Using the numbers 3, 7 and 25, make 46. Show your work.", "Write a haiku about the sea."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    samples, new_tokens = 8, 40
    engine = LLMEngine(
        config, params,
        EngineConfig(block_size=16, num_blocks=128, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=128, eos_token_ids=()),
    )  # fmt: skip
    outs = engine.generate(
        prompts, SamplingParams(n=samples, temperature=1.0, max_tokens=new_tokens, seed=3, ignore_eos=True)
    )
    rows = [list(p) + list(s.tokens) for p, o in zip(prompts, outs) for s in o.outputs]
    behaviour = np.concatenate([np.asarray(s.logprobs, np.float64) for o in outs for s in o.outputs])
    width = _trainer_bucket(max(map(len, rows)))
    tokens = np.zeros((len(rows), width), np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], valid[i, : len(r)] = r, True
    recompute = jax.jit(
        lambda p, t, v: logprobs(p, t, config=config, attention_context=DenseContext(v), chunk_size=256)
    )
    starts = [len(p) - 1 for p in prompts for _ in range(samples)]

    out = np.asarray(recompute(params, tokens, valid))
    trainer = np.concatenate([out[i, a : a + new_tokens] for i, a in enumerate(starts)]).astype(np.float64)
    assert trainer.size == behaviour.size == len(prompts) * samples * new_tokens >= 512
    # Sampled at temperature 1 from a real model: log-probs spread over several nats.
    assert behaviour.min() < -2.0 and np.all(behaviour <= 0.0)
    delta = np.abs(trainer - behaviour)
    p50, p95 = np.quantile(delta, [0.5, 0.95])
    assert p95 <= 2e-5, f"|delta logprob| p50 {p50:.2e} p95 {p95:.2e} max {delta.max():.2e}"


# ---------------------------------------------------------------- the dtype policy (fast)
BF16 = ModelConfig.tiny(param_dtype="bfloat16", compute_dtype="bfloat16")
BF16_PARAMS = init_params(BF16, jax.random.key(0), std=0.25)  # bfloat16 values
ENGINE = EngineConfig(block_size=8, num_blocks=32, max_num_seqs=8, max_model_len=64, eos_token_ids=())
PROMPT = [5, 6, 7, 8, 9]


def _start_worker(address):
    tree = jax.tree_util.tree_map(np.asarray, BF16_PARAMS)
    with ParamClient(address, timeout_s=10) as client:
        client.push(tree, 1, metadata={"model_config": dataclasses.asdict(BF16)})
    worker = Worker(WorkerConfig(paramserver=address, weights_poll_s=0.05, rpc_timeout_s=10), ENGINE)
    worker.start()
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def _worker_sample(worker, address):
    request = rp.GenerateRequest(
        request_id="a",
        prompt_token_ids=tuple(PROMPT),
        n=1,
        sampling=rp.SamplingParams(max_tokens=8, temperature=1.0, seed=1),
    )
    with rp.RpcClient(worker.address, timeout_s=600, client_id="t") as client:
        rid = client.send_request(request)
        _, reply = client.recv_reply({rid}, timeout_s=600, operation="GenerateResult")
    return reply.message.samples[0]


def _policy_lines(caplog):
    return [
        r.getMessage() for r in caplog.records if r.name == "rlax.model" and "dtype policy" in r.getMessage()
    ]


@pytest.mark.parametrize("forced", [False, True], ids=["default", "RLAX_BF16_ON_CPU=1"])
def test_worker_and_learner_follow_the_same_dtype_policy(tmp_path, monkeypatch, caplog, forced):
    from rlax_trainer import Learner, LearnerConfig, OptimizerConfig

    if forced:
        monkeypatch.setenv(BF16_ON_CPU_ENV, "1")
    else:
        monkeypatch.delenv(BF16_ON_CPU_ENV, raising=False)
    want = "bfloat16" if forced else "float32"
    caplog.set_level(logging.WARNING, logger="rlax.model")
    with running_server(tmp_path / "ps") as address:
        worker, thread = _start_worker(address)
        try:
            sample = _worker_sample(worker, address)
        finally:
            worker.stop()
            thread.join(timeout=10)
    assert not worker.errors
    engine = worker.engine
    assert (engine.model_config.param_dtype, engine.model_config.compute_dtype) == (want, want)
    assert {x.dtype for x in jax.tree.leaves(engine.runner.params)} == {jnp.dtype(want)}
    assert len(_policy_lines(caplog)) == (0 if forced else 1)

    # The engine's log-probs are those of a model computing in `want` on the bf16 weights:
    # a float32 teacher-forced pass matches the float32 engine to 1e-5 and the forced-bf16
    # engine only to bf16 precision (so this check tells the two apart).
    f32 = BF16.replace(param_dtype="float32", compute_dtype="float32")
    reference = teacher_forced_logprobs(
        jax.tree.map(lambda x: x.astype(jnp.float32), BF16_PARAMS), PROMPT, sample.token_ids, config=f32
    )
    gap = np.abs(np.asarray(sample.logprobs) - reference).max()
    assert (gap > 1e-4) if forced else (gap < 1e-5), gap

    caplog.clear()
    learner = Learner(
        BF16, LearnerConfig(mode="sft", global_batch=2, optimizer=OptimizerConfig()), BF16_PARAMS
    )
    assert learner.model_config == engine.model_config
    assert len(_policy_lines(caplog)) == (0 if forced else 1)


@pytest.mark.parametrize("forced", [False, True], ids=["default", "RLAX_BF16_ON_CPU=1"])
def test_trainer_process_learner_config_follows_the_policy(monkeypatch, forced):
    from rlax_core.config import load_config
    from rlax_trainer.trainer_process import learner_config

    if forced:
        monkeypatch.setenv(BF16_ON_CPU_ENV, "1")
    else:
        monkeypatch.delenv(BF16_ON_CPU_ENV, raising=False)
    config = load_config(ROOT / "configs" / "demo.yaml", ["model.param_dtype=bfloat16"])
    want = "bfloat16" if forced else "float32"
    assert learner_config(config, mode="rl").param_dtype == want
    assert learner_config(config, mode="sft").param_dtype == want
