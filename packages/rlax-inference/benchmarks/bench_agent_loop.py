"""The agent loop's overhead: multi-turn generation beside single-turn on the same engine, with
the prefix cache's partial-block reuse (issue 32) on and off, side by side in one run.

Workloads (P prompts x n samples; every trajectory is T model turns of L tokens separated by
environment turns; single-turn generates T x L tokens in one go, so both make the same number
of model tokens; EOS is ignored, so turn lengths are exact):

- `demo`: the model shapes of `configs/multiturn-demo.yaml` (hidden 96, 2 layers, 4/2 heads,
  the character vocabulary), 16 problems "123*45=" (<bos> + 7 characters) x 8 samples, 3 turns
  of 12 tokens (the demo's `max_new_tokens`), each answered by the calculator's "(5535)" (6-7
  tokens); the context is 64 tokens (the demo's 48 cannot hold three 12-token turns).
- `tiny`: the tiny test Llama, 16 prompts of 16-32 random tokens x 4 samples, 3 turns of 32
  tokens, environment turns of 8 tokens (long prompts).
- `smollm2-135m` (only with RLAX_BENCH_AGENT_SMOLLM2=1: many minutes on a 2-core CPU): the
  `tiny` workload with turns of 16 tokens on SmolLM2-135M-Instruct (float32).

Each workload runs on one engine. `compile_all_shapes` compiles every program it can call and
each run goes once untimed first; the timed region fails if anything compiles in it. Then R rounds
(RLAX_BENCH_AGENT_ROUNDS, default 7: a run takes well under a second) each time single-turn and multi-turn with partial-block
reuse on (`KVCacheManager.enable_partial_blocks`) and off (whole 16-token blocks, as before
issue 32), the prefix cache emptied before every run; the best time of each is reported.

Reported per workload: model tokens/s of each run and the ratios multi/single (on and off)
and single on/off; the same runs on an engine that runs prefill in calls of its own
(`EngineConfig.fold_prefill="off"`, as before it) and the model calls of each; once
multi-turn with a 20 ms environment step (a slow tool); the later turns' prompt tokens
served from the prefix cache, as a fraction of those turns' prompt tokens, beside the most any cache can serve (a later turn's
observation and the previous turn's last token, whose K/V were never computed, are new);
peak KV blocks and the process's peak RSS.

RLAX_BENCH_AGENT_PROMPTS shrinks the workloads (default 16). RLAX_BENCH_JSON=FILE writes one
JSON object with `multi_over_single_<workload>`, `later_turn_prefill_cached_fraction_<workload>`
and the rest of `FIGURES` (`multi_over_single_tiny` is the tiny test Llama's long prompts).
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
import pytest

import rlax_protocol as rp
from rlax_core.tokenizer import CharTokenizer
from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_inference.agent_loop import AgentLoop
from rlax_inference.model_runner import COMPILATIONS
from rlax_inference.warm_up import compile_all_shapes
from rlax_model import ModelConfig, find_smollm2_gguf, init_params, load_gguf
from rlax_protocol.atomic_files import atomic_write_bytes

PROMPTS = int(os.environ.get("RLAX_BENCH_AGENT_PROMPTS", "16"))
ROUNDS = int(os.environ.get("RLAX_BENCH_AGENT_ROUNDS", "7"))
TURNS = 3
BLOCK = 16
FIGURES: dict[str, float] = {}  # this run's headline figures (RLAX_BENCH_JSON)


@dataclass
class Workload:
    """Prompts, their per-trajectory observation tokens, and the shape of the run."""

    config: ModelConfig
    params: dict
    prompts: list[list[int]]
    observations: list[list[int]]  # per prompt: the environment's tokens after each model turn
    samples: int
    turn_tokens: int
    max_len: int


@dataclass
class _Step:
    observation: str
    done: bool
    reward: float | None = None
    tool_calls: int = 1
    tool_errors: int = 0


@dataclass
class _FixedEnv:
    """Answers every turn with its trajectory's observation ids, done after TURNS turns."""

    observation: str
    delay_s: float = 0.0
    turns: int = 0

    def step(self, model_turn: str) -> _Step:
        self.turns += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return _Step("", True, tool_calls=0) if self.turns >= TURNS else _Step(self.observation, False)


class _Codec:
    """The observation travels in the request's record: comma-joined token ids."""

    stop_strings: tuple[str, ...] = ()

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def new_environment(self, name: str, record_json: str) -> _FixedEnv:
        return _FixedEnv(json.loads(record_json), self.delay_s)

    def turn_text(self, token_ids: list[int]) -> str:
        return ""

    def env_turn_ids(self, observation: str, *, after_end_of_turn: bool) -> list[int]:
        return [int(t) for t in observation.split(",")]


@dataclass
class _Run:
    seconds: float
    later_prompt_tokens: int = 0  # prompt tokens of every later turn's request
    later_cached_tokens: int = 0  # of them, found in the prefix cache
    later_new_tokens: int = 0  # of them, never computed before (observation + last model token)
    calls: tuple[int, int, int] = (0, 0, 0)  # model calls: (decode, prefill, mixed)
    extra: dict[str, float] = field(default_factory=dict)


def demo_workload() -> Workload:
    tok = CharTokenizer()
    config = ModelConfig.tiny(
        vocab_size=tok.vocab_size, hidden_size=96, intermediate_size=288, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=24, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    params = init_params(config, jax.random.key(0), std=0.25)
    rng = np.random.default_rng(0)
    pairs = [(int(rng.integers(100, 1000)), int(rng.integers(10, 100))) for _ in range(PROMPTS)]
    prompts = [tok.encode(f"{a}*{b}=", add_bos=True) for a, b in pairs]
    observations = [tok.encode(f"({a * b})") for a, b in pairs]
    return Workload(config, params, prompts, observations, samples=8, turn_tokens=12, max_len=64)


def long_workload(model: str) -> Workload:
    if model == "tiny":
        config = ModelConfig.tiny(max_position_embeddings=512)
        params, turn_tokens = init_params(config, jax.random.key(0), std=0.25), 32
    else:
        config, params = load_gguf(find_smollm2_gguf())
        turn_tokens = 16
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 100, size=rng.integers(16, 33))] for _ in range(PROMPTS)]
    observation = [int(t) for t in np.random.default_rng(1).integers(3, 100, size=8)]
    max_len = 32 + TURNS * (turn_tokens + len(observation)) + 8
    return Workload(config, params, prompts, [observation] * PROMPTS, 4, turn_tokens, max_len)


def _engine(w: Workload, *, fold_prefill: str = "on") -> LLMEngine:
    seqs = len(w.prompts) * w.samples
    return LLMEngine(
        w.config,
        w.params,
        EngineConfig(
            block_size=BLOCK, num_blocks=2 * seqs * (-(-w.max_len // BLOCK) + 1) + 8, max_num_seqs=seqs,
            max_num_batched_tokens=max(2048, seqs * 8), max_model_len=w.max_len, eos_token_ids=(),
            num_decode_steps=8, fold_prefill=fold_prefill,
        ),
    )  # fmt: skip


def _single_turn(engine: LLMEngine, w: Workload) -> _Run:
    tokens = TURNS * w.turn_tokens
    params = SamplingParams(n=w.samples, temperature=1.0, max_tokens=tokens, seed=0, ignore_eos=True)
    started = time.perf_counter()
    outs = engine.generate(w.prompts, params)
    elapsed = time.perf_counter() - started
    assert sum(len(c.tokens) for o in outs for c in o.outputs) == len(w.prompts) * w.samples * tokens
    return _Run(elapsed)


def _multi_turn(engine: LLMEngine, w: Workload, delay_s: float = 0.0) -> _Run:
    loop = AgentLoop(lambda: engine, _Codec(delay_s), max_model_len=engine.config.max_model_len)
    sampling = rp.SamplingParams(max_tokens=w.turn_tokens, temperature=1.0, seed=0)
    params = SamplingParams(n=w.samples, temperature=1.0, max_tokens=w.turn_tokens, seed=0, ignore_eos=True)
    run = _Run(0.0)
    started = time.perf_counter()
    for key, (prompt, observation) in enumerate(zip(w.prompts, w.observations, strict=True)):
        spec = rp.AgentSpec(
            environment="fixed", record=json.dumps(",".join(map(str, observation))), max_turns=TURNS,
            max_total_tokens=10_000,
        )  # fmt: skip
        request = rp.GenerateRequest(
            request_id=f"r{key}", prompt_token_ids=tuple(prompt), sampling=sampling, n=w.samples, agent=spec
        )
        loop.start(key, request, params)
    done: list = []
    while len(done) < len(w.prompts):
        if engine.has_unfinished:
            for output in engine.step():
                if output.request_id.count(":") == 2:  # "key:sample:turn": a later turn
                    run.later_prompt_tokens += len(output.prompt)
                    run.later_cached_tokens += output.num_cached_tokens
                    run.later_new_tokens += len(w.observations[int(output.request_id.split(":")[0])]) + 1
                done += loop.on_output(output)
        else:
            threading.Event().wait(0.0005)
        done += loop.poll()
    run.seconds = time.perf_counter() - started
    loop.close()
    model_tokens = sum(sum(s.model_mask) for _, _, samples, _ in done for s in samples)
    assert model_tokens == len(w.prompts) * w.samples * TURNS * w.turn_tokens
    return run


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fresh(
    engine: LLMEngine, *, partial: bool, run: Callable[[LLMEngine, Workload], _Run], w: Workload
) -> _Run:
    """`run` from an empty prefix cache (nothing of the previous run is reused), with its model calls."""
    engine.kv.pool.reset_prefix_cache()
    engine.kv.enable_partial_blocks = partial
    before = _calls(engine)
    got = run(engine, w)
    got.calls = tuple(b - a for a, b in zip(before, _calls(engine), strict=True))  # type: ignore[assignment]
    return got


def _calls(engine: LLMEngine) -> tuple[int, int, int]:
    return engine.num_decode_calls, engine.num_prefill_calls, engine.num_mixed_calls


def _write_figures() -> None:
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        atomic_write_bytes(pathlib.Path(target), json.dumps(FIGURES, indent=1).encode())


@pytest.mark.timeout(5400)
@pytest.mark.parametrize("model", ["demo", "tiny", "smollm2-135m"])
def test_multi_turn_overhead_vs_single_turn(benchmark, model):
    if model == "smollm2-135m" and os.environ.get("RLAX_BENCH_AGENT_SMOLLM2") != "1":
        pytest.skip("SmolLM2 runs many minutes on a small CPU: set RLAX_BENCH_AGENT_SMOLLM2=1")
    w = demo_workload() if model == "demo" else long_workload(model)
    engine = _engine(w)
    # The same engine with prefill in calls of its own (before `fold_prefill`): partial blocks on.
    separate = _engine(w, fold_prefill="off")
    model_tokens = len(w.prompts) * w.samples * TURNS * w.turn_tokens
    runs = {"single": _single_turn, "multi": _multi_turn}
    # (key, engine, partial blocks): every run of a round.
    settings = [
        (f"{name}_{'on' if partial else 'off'}", engine, partial, fn)
        for partial in (True, False)
        for name, fn in runs.items()
    ]
    settings += [(f"{name}_separate", separate, True, fn) for name, fn in runs.items()]
    # Warm-up: every program the engines can call (when the environment threads finish varies
    # from run to run, and with it the batch shapes), then each run once.
    compile_s = compile_all_shapes(engine, [SamplingParams(temperature=1.0)])
    compile_all_shapes(separate, [SamplingParams(temperature=1.0)])
    for _, e, partial, fn in settings:
        _fresh(e, partial=partial, run=fn, w=w)
    compiled = sum(COMPILATIONS.values())
    best: dict[str, _Run] = {}

    def timed() -> None:
        for _ in range(ROUNDS):
            for key, e, partial, fn in settings:
                got = _fresh(e, partial=partial, run=fn, w=w)
                if key not in best or got.seconds < best[key].seconds:
                    best[key] = got

        # A slow tool (20 ms a step, in the loop's threads): once, with partial blocks on.
        best["multi_slow_env"] = _fresh(engine, partial=True, run=lambda e, w: _multi_turn(e, w, 0.02), w=w)

    benchmark.pedantic(timed, rounds=1, iterations=1)
    if sum(COMPILATIONS.values()) != compiled:
        raise AssertionError(f"the timed run recompiled: {dict(COMPILATIONS)}")
    rate = {k: model_tokens / r.seconds for k, r in best.items()}
    on, off = best["multi_on"], best["multi_off"]
    frac_on, frac_off = (r.later_cached_tokens / r.later_prompt_tokens for r in (on, off))
    ceiling = 1 - on.later_new_tokens / on.later_prompt_tokens
    c = w.config
    lines = [
        f"[{model}] {len(w.prompts)} prompts x {w.samples} samples x {TURNS} turns x {w.turn_tokens} tokens "
        f"(hidden {c.hidden_size}, {c.num_layers} layers, vocab {c.vocab_size}); {model_tokens} model tokens "
        f"each way; best of {ROUNDS} rounds",
        "                        partial blocks on      off (whole blocks)",
        f"  single-turn tok/s   : {rate['single_on']:10.1f}  {rate['single_off']:10.1f}   "
        f"-> on/off {rate['single_on'] / rate['single_off']:.3f}",
        f"  multi-turn tok/s    : {rate['multi_on']:10.1f}  {rate['multi_off']:10.1f}   "
        f"-> on/off {rate['multi_on'] / rate['multi_off']:.3f}",
        f"  multi / single      : {rate['multi_on'] / rate['single_on']:10.3f}  "
        f"{rate['multi_off'] / rate['single_off']:10.3f}",
        f"  prefill in the decode call (fold_prefill) vs calls of its own: single-turn "
        f"{rate['single_on']:.1f} vs {rate['single_separate']:.1f} tok/s ({rate['single_on'] / rate['single_separate']:.3f}x), "
        f"multi-turn {rate['multi_on']:.1f} vs {rate['multi_separate']:.1f} ({rate['multi_on'] / rate['multi_separate']:.3f}x); "
        f"multi / single {rate['multi_separate'] / rate['single_separate']:.3f} without folding",
        f"  model calls (decode, prefill, mixed): single {best['single_on'].calls} vs {best['single_separate'].calls}, "
        f"multi {best['multi_on'].calls} vs {best['multi_separate'].calls}",
        f"  multi, 20 ms environment steps: {rate['multi_slow_env']:.1f} tok/s "
        f"-> {rate['multi_slow_env'] / rate['single_on']:.3f}x single-turn",
        f"  later turns' prompt tokens from the cache: {frac_on:.1%} on, {frac_off:.1%} off "
        f"({on.later_cached_tokens} / {off.later_cached_tokens} of {on.later_prompt_tokens}; at most "
        f"{ceiling:.1%}: {on.later_new_tokens} are observations and never-fed last tokens)",
        f"  compile_all_shapes {compile_s:.1f} s before the timed runs; peak RSS {_peak_rss_mb():.0f} MB; peak KV blocks {engine.kv.pool.peak_used} of {engine.kv.pool.num_blocks}",
    ]
    print("\n" + "\n".join(lines))
    figures = {
        f"multi_over_single_{model}": rate["multi_on"] / rate["single_on"],
        f"multi_over_single_{model}_partial_off": rate["multi_off"] / rate["single_off"],
        f"multi_over_single_{model}_separate_prefill": rate["multi_separate"] / rate["single_separate"],
        f"single_folded_over_separate_{model}": rate["single_on"] / rate["single_separate"],
        f"multi_folded_over_separate_{model}": rate["multi_on"] / rate["multi_separate"],
        f"multi_model_calls_{model}": float(sum(best["multi_on"].calls)),
        f"multi_model_calls_separate_{model}": float(sum(best["multi_separate"].calls)),
        f"single_on_over_off_{model}": rate["single_on"] / rate["single_off"],
        f"multi_on_over_off_{model}": rate["multi_on"] / rate["multi_off"],
        f"multi_slow_env_over_single_{model}": rate["multi_slow_env"] / rate["single_on"],
        f"later_turn_prefill_cached_fraction_{model}": frac_on,
        f"later_turn_prefill_cached_fraction_{model}_partial_off": frac_off,
        f"later_turn_prefill_cacheable_fraction_{model}": ceiling,
        f"single_tok_s_{model}": rate["single_on"],
        f"multi_tok_s_{model}": rate["multi_on"],
    }
    if model == "smollm2-135m":  # the name for it
        figures["multi_over_single_smollm2"] = figures[f"multi_over_single_{model}"]
    benchmark.extra_info.update(figures, peak_rss_mb=_peak_rss_mb())
    FIGURES.update(figures)
    _write_figures()
