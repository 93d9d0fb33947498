"""The agent loop's overhead: multi-turn generation beside single-turn on the same engine.

Workload: P prompts x n samples. Multi-turn: every trajectory is T model turns of L tokens
separated by environment turns of E tokens (an environment that answers at once, or after
`slow_env_ms`: the loop's own cost, then a slow tool's); single-turn: the same prompts
generate T x L tokens in one go, so both make the same number of model tokens. Reported:
model tokens/s of each and their ratio, the prefix-cache hits that spare re-computing each
trajectory's earlier turns (in tokens, beside what a cold prefill of every turn would
compute), peak KV blocks and the process's peak RSS. EOS is ignored, so turn lengths are
exact. Models: the tiny test Llama and SmolLM2-135M-Instruct (float32, CPU).

RLAX_BENCH_AGENT_PROMPTS shrinks the workload (default 16).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass

import jax
import numpy as np
import pytest

import rlax_protocol as rp
from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_inference.agent_loop import AgentLoop
from rlax_model import ModelConfig, find_smollm2_gguf, init_params, load_gguf

PROMPTS = int(os.environ.get("RLAX_BENCH_AGENT_PROMPTS", "16"))
SAMPLES = 4
TURNS = 3
ENV_TOKENS = 8
BLOCK = 16


@dataclass
class _Step:
    observation: str
    done: bool
    reward: float | None = None
    tool_calls: int = 1
    tool_errors: int = 0


class _FixedEnv:
    """Answers every turn with the same ENV_TOKENS tokens (after `delay_s`), done after TURNS turns."""

    def __init__(self, observation: str, delay_s: float) -> None:
        self.observation = observation
        self.delay_s = delay_s
        self.turns = 0

    def reset(self, record: object) -> str:
        return ""

    def step(self, model_turn: str) -> _Step:
        self.turns += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return _Step("", True, tool_calls=0) if self.turns >= TURNS else _Step(self.observation, False)


class _Codec:
    stop_strings: tuple[str, ...] = ()

    def __init__(self, observation_ids: list[int], delay_s: float) -> None:
        self.observation = ",".join(map(str, observation_ids))
        self.delay_s = delay_s

    def new_environment(self, name: str, record_json: str) -> _FixedEnv:
        return _FixedEnv(self.observation, self.delay_s)

    def turn_text(self, token_ids: list[int]) -> str:
        return ""

    def env_turn_ids(self, observation: str, *, after_end_of_turn: bool) -> list[int]:
        return [int(t) for t in observation.split(",")]


def _engine(config: ModelConfig, params, max_len: int) -> LLMEngine:
    seqs = PROMPTS * SAMPLES
    return LLMEngine(
        config,
        params,
        EngineConfig(
            block_size=BLOCK, num_blocks=2 * seqs * (-(-max_len // BLOCK) + 1) + 8, max_num_seqs=seqs,
            max_num_batched_tokens=max(2048, seqs * 8), max_model_len=max_len, eos_token_ids=(),
            num_decode_steps=8,
        ),
    )  # fmt: skip


def _single_turn(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=tokens, seed=0, ignore_eos=True)
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    assert sum(len(c.tokens) for o in outs for c in o.outputs) == PROMPTS * SAMPLES * tokens
    return elapsed


def _multi_turn(engine: LLMEngine, prompts: list[list[int]], turn_tokens: int, delay_s: float) -> float:
    observation = [int(t) for t in np.random.default_rng(1).integers(3, 100, size=ENV_TOKENS)]
    loop = AgentLoop(lambda: engine, _Codec(observation, delay_s), max_model_len=engine.config.max_model_len)
    spec = rp.AgentSpec(environment="fixed", record="{}", max_turns=TURNS, max_total_tokens=10_000)
    sampling = rp.SamplingParams(max_tokens=turn_tokens, temperature=1.0, seed=0)
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=turn_tokens, seed=0, ignore_eos=True)
    started = time.perf_counter()
    for key, prompt in enumerate(prompts):
        request = rp.GenerateRequest(
            request_id=f"r{key}", prompt_token_ids=tuple(prompt), sampling=sampling, n=SAMPLES, agent=spec
        )
        loop.start(key, request, params)
    done: list = []
    while len(done) < len(prompts):
        if engine.has_unfinished:
            for output in engine.step():
                done += loop.on_output(output)
        else:
            threading.Event().wait(0.0005)
        done += loop.poll()
    elapsed = time.perf_counter() - started
    loop.close()
    model_tokens = sum(sum(s.model_mask) for _, _, samples, _ in done for s in samples)
    assert model_tokens == PROMPTS * SAMPLES * TURNS * turn_tokens
    return elapsed


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_multi_turn_overhead_vs_single_turn(benchmark, model):
    if model == "tiny":
        config = ModelConfig.tiny(max_position_embeddings=512)
        params = init_params(config, jax.random.key(0), std=0.25)
        turn_tokens = 32
    else:
        config, params = load_gguf(find_smollm2_gguf())
        turn_tokens = 16
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 100, size=rng.integers(16, 33))] for _ in range(PROMPTS)]
    max_len = 32 + TURNS * (turn_tokens + ENV_TOKENS) + 8
    model_tokens = PROMPTS * SAMPLES * TURNS * turn_tokens
    # Warm both paths (compiles every shape) on their own engines, then time fresh runs.
    single_engine, multi_engine = _engine(config, params, max_len), _engine(config, params, max_len)
    _single_turn(single_engine, prompts, TURNS * turn_tokens)
    _multi_turn(multi_engine, prompts, turn_tokens, 0.0)
    times: dict[str, float] = {}

    def timed() -> None:
        times["single"] = _single_turn(single_engine, prompts, TURNS * turn_tokens)
        hits_before = multi_engine.num_prefix_cache_hit_tokens
        computed_before = multi_engine.num_computed_prefill_tokens
        times["multi"] = _multi_turn(multi_engine, prompts, turn_tokens, 0.0)
        times["hits"] = multi_engine.num_prefix_cache_hit_tokens - hits_before
        times["computed"] = multi_engine.num_computed_prefill_tokens - computed_before
        times["multi_slow_env"] = _multi_turn(multi_engine, prompts, turn_tokens, 0.02)

    benchmark.pedantic(timed, rounds=1, iterations=1)
    single, multi, slow = (model_tokens / times[k] for k in ("single", "multi", "multi_slow_env"))
    # A cold prefill of every later turn would compute the whole trajectory so far.
    cold = sum(
        len(p) + t * turn_tokens + t * ENV_TOKENS for p in prompts for t in range(1, TURNS)
    ) * SAMPLES + sum(len(p) for p in prompts)
    lines = [
        f"[{model}] {PROMPTS} prompts x {SAMPLES} samples x {TURNS} turns x {turn_tokens} tokens "
        f"(environment turns of {ENV_TOKENS} tokens); {model_tokens} model tokens each way",
        f"  single-turn ({TURNS * turn_tokens} tokens at once) : {single:9.1f} tok/s ({times['single']:.2f} s)",
        f"  multi-turn, instant environment        : {multi:9.1f} tok/s ({times['multi']:.2f} s) "
        f"-> {multi / single:.2f}x single-turn",
        f"  multi-turn, 20 ms per environment step : {slow:9.1f} tok/s ({times['multi_slow_env']:.2f} s) "
        f"-> {slow / single:.2f}x single-turn",
        f"  prefill of later turns: {times['computed']:.0f} tokens computed, {times['hits']:.0f} from the "
        f"prefix cache (a cold prefill of every turn computes {cold})",
        f"  peak RSS {_peak_rss_mb():.0f} MB; peak KV blocks {multi_engine.kv.pool.peak_used} of "
        f"{multi_engine.kv.pool.num_blocks}",
    ]
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update(
        single_tok_s=single, multi_tok_s=multi, multi_slow_env_tok_s=slow, ratio=multi / single,
        ratio_slow_env=slow / single, prefix_hit_tokens=times["hits"], computed_prefill_tokens=times["computed"],
        cold_prefill_tokens=cold, peak_rss_mb=_peak_rss_mb(),
    )  # fmt: skip
