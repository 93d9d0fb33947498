"""Training-inference alignment on SmolLM2-135M-Instruct, and bf16 vs f32 generation speed on this backend.

Same-version rollouts, as the paper measures them: `LLMEngine` samples completions (its
behaviour log-probs come from the paged prefill/decode path), then the trainer's log-prob
function (`rlax_model.logprobs` as `rlax_trainer.learner` calls it: dense teacher-forced
pass over right-padded rows, padded to the trainer's length bucket, chunked vocabulary
projection) recomputes the log-prob of every sampled token from the same weights.
Reported per dtype and mode: p50/p95/max |delta logprob| over all sampled tokens, the
share of tokens that agree to the bit, the importance ratio range exp(trainer - engine),
and the seconds per engine call and per trainer call. Two modes: the defaults, and the
aligned mode (`EngineConfig(aligned=True)` against the trainer's `batch_invariant` pass:
blocked attention and `rlax_model.layers.ALIGNED_COMPILER_OPTIONS` on both sides; keys
`aligned_float32_p95`, ...).

The dtypes are forced (`rlax_model.dtype_policy(..., allow_bf16_on_cpu=True)`), so the
bfloat16 row is bf16 compute even on a CPU, where the default policy would compute in
float32. The speed section times the engine alone, warm, on 1 prompt x 8 samples x 64 new
tokens, each dtype and mode taking turns in this process, and reports the ratios.

Targets (issue 28): p95 <= 1e-6 in float32 and <= 0.02 in bfloat16 over >= 512 tokens.

Measured 2026-12 on the shared 2-core CPU under another job's load (load average 4-5),
1 prompt x 8 x 64 = 512 tokens per row:
  float32           p50 1.9e-6  p95 1.5e-5  max 2.7e-5  (37% of tokens equal)  ratio 1.0000..1.0000
  bfloat16          p50 4.9e-3  p95 3.6e-2  max 0.40    (1% equal)             ratio 0.94..1.49
  aligned float32   p50 0       p95 0       max 0       (100% equal)           ratio 1 exactly
  aligned bfloat16  p50 0       p95 0       max 0       (100% equal)           ratio 1 exactly
  multi-turn (2 prompts x 8 x two 32-token replies with a tool turn between them, the second
  reply's prompt prefilled on the first's cached blocks: 1,040 tokens from the prefix cache),
  2026-12-03: float32 p95 1.34e-5 (30% equal) -> aligned 0 (100%); bfloat16 p95 0.045 ->
  aligned 0 (100%); keys *_multi_turn_p95.
  engine alone, warm, 1x8x64, tok/s (best of 3, alternating): float32 79.3, float32 aligned 66.5
  (0.84x), bfloat16 forced 25.1, bfloat16 forced aligned 19.8 (0.79x); bfloat16 by the CPU
  policy (float32, the same program as float32) 100.5: the load moved equal programs by 27%.
  The default mode's programs are unchanged by the aligned mode (their optimized HLO is
  identical to the one before it), so its speed is too.
What the aligned mode changes (all of it at once was measured, not each part's share): the
decode kernel's page-by-page softmax (fast-math, its own exp) and the prefill's one matmul
over all keys become the trainer's blocked attention over keys placed at their positions;
the sampler's block-sum normaliser becomes the trainer's ordered log-softmax; matmuls of
one row are padded to two; and XLA:CPU's YNNPACK matmuls, which round a row by the row
count (up to 32 rows apart from taller ones) and attention's batched matmuls by the query
count at every size, give way to Eigen's, which do not from 2 rows on.

Run: `nox -s bench -- -k alignment`, or directly `python bench_alignment.py`.
RLAX_BENCH_ALIGN_PROMPTS sets the prompts (default 2: 2 x 8 samples x 64 tokens = 1024 tokens per dtype).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_core.tokenizer import Tokenizer
from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_model import (
    DenseContext,
    ModelConfig,
    dense_causal_attention,
    dtype_policy,
    find_smollm2_gguf,
    load_gguf,
    logprobs,
)
from rlax_model.attention import KEY_BLOCK
from rlax_model.layers import ALIGNED_COMPILER_OPTIONS, ALIGNED_ROW_BLOCK, matmul_row_blocks

PROMPTS = int(os.environ.get("RLAX_BENCH_ALIGN_PROMPTS", "2"))
SAMPLES = 8
NEW_TOKENS = 64
QUESTIONS = [
    "What is 17 times 23? Think step by step.",
    "Write a haiku about the sea.",
    "Name three prime numbers larger than 50 and explain why they are prime.",
    "Using the numbers 3, 7 and 25, make 46 with + - * /. Show your work.",
    "Explain what a hash table is in two sentences.",
    "Translate 'the cat sleeps on the mat' into French.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List the steps to boil an egg.",
]


def trainer_bucket(n: int) -> int:
    """`rlax_trainer.padding.bucketed_length` (16, 32, 40, 48, 56, 64, 80, ...): the trainer's padding."""
    if n <= 16:
        return 16
    top = 1 << (n - 1).bit_length()
    step = max(top // 8, 1)
    return -(-n // step) * step


def _trainer_logprobs_impl(params, tokens, valid, *, config, chunk_size, aligned):
    if not aligned:
        return logprobs(
            params, tokens, config=config, attention_context=DenseContext(valid), chunk_size=chunk_size
        )
    # What `rlax_trainer.learner` traces under `trainer.batch_invariant`.
    attention = functools.partial(
        dense_causal_attention, sliding_window=config.sliding_window, key_block=KEY_BLOCK
    )
    with matmul_row_blocks(ALIGNED_ROW_BLOCK):
        return logprobs(
            params,
            tokens,
            config=config,
            attention=attention,
            attention_context=DenseContext(valid),
            chunk_size=chunk_size,
        )


_STATICS = ("config", "chunk_size", "aligned")
_trainer_logprobs = {
    False: jax.jit(_trainer_logprobs_impl, static_argnames=_STATICS),
    True: jax.jit(
        _trainer_logprobs_impl, static_argnames=_STATICS, compiler_options=ALIGNED_COMPILER_OPTIONS
    ),
}


def trainer_logprobs(
    config: ModelConfig, params, rows: list[list[int]], chunk_size: int = 256, *, aligned: bool = False
) -> np.ndarray:
    """The learner's recompute: rows right-padded to the trainer's bucket; [B, S-1] float32."""
    width = trainer_bucket(max(len(r) for r in rows))
    tokens = np.zeros((len(rows), width), np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
        valid[i, : len(r)] = True
    fn = _trainer_logprobs[aligned]
    return np.asarray(fn(params, tokens, valid, config=config, chunk_size=chunk_size, aligned=aligned))


def smollm2_prompts(n: int) -> list[list[int]]:
    tok = Tokenizer.from_gguf(find_smollm2_gguf())
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True
        )
        for i in range(n)
    ]


def make_engine(config: ModelConfig, params, num_seqs: int, *, aligned: bool = False) -> LLMEngine:
    max_len = 128 + NEW_TOKENS
    return LLMEngine(
        config,
        params,
        EngineConfig(
            block_size=16, num_blocks=num_seqs * (-(-max_len // 16)) + 16, max_num_seqs=num_seqs,
            max_num_batched_tokens=max(2048, num_seqs), max_model_len=max_len, eos_token_ids=(),
            aligned=aligned,
        ),
    )  # fmt: skip


def cast(config: ModelConfig, params):
    return jax.tree.map(lambda x: jnp.asarray(x, config.param_jnp_dtype), params)


def measure_alignment(
    config: ModelConfig, params, prompts: list[list[int]], *, seed: int = 0, aligned: bool = False
) -> dict[str, float]:
    """Generate SAMPLES x NEW_TOKENS per prompt with the engine, recompute with the trainer's
    function; `aligned`: the engine's aligned mode and the trainer's batch-invariant pass."""
    params = cast(config, params)
    engine = make_engine(config, params, len(prompts) * SAMPLES, aligned=aligned)
    sp = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS, seed=seed, ignore_eos=True)
    engine.generate(prompts, SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=2, seed=seed))  # compile
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    engine_s = time.perf_counter() - start
    rows, behaviour, spans = [], [], []
    for prompt, out in zip(prompts, outs, strict=True):
        for sample in out.outputs:
            rows.append(list(prompt) + list(sample.tokens))
            behaviour.append(np.asarray(sample.logprobs, np.float64))
            spans.append((len(prompt) - 1, len(prompt) - 1 + len(sample.tokens)))
    trainer_logprobs(config, params, rows, aligned=aligned)  # compile
    start = time.perf_counter()
    recomputed = trainer_logprobs(config, params, rows, aligned=aligned)
    trainer_s = time.perf_counter() - start
    trainer = np.concatenate([recomputed[i, a:b] for i, (a, b) in enumerate(spans)]).astype(np.float64)
    engine_lp = np.concatenate(behaviour)
    delta = np.abs(trainer - engine_lp)
    ratio = np.exp(trainer - engine_lp)
    return {
        "tokens": float(delta.size),
        "equal": float(np.mean(delta == 0)),
        "p50": float(np.quantile(delta, 0.5)),
        "p95": float(np.quantile(delta, 0.95)),
        "max": float(delta.max()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "engine_s": engine_s,
        "trainer_s": trainer_s,
    }


def measure_multi_turn_alignment(
    config: ModelConfig, params, prompts: list[list[int]], tool_text: str, *, aligned: bool = False
) -> dict[str, float]:
    """Two model turns per sample with a tool turn between them, as an agent loop makes them:
    each prompt's SAMPLES first replies (NEW_TOKENS // 2 tokens), then per reply a second
    request whose prompt is prompt + reply + the chat-formatted tool turn, prefilled on top of
    the first turn's cached blocks (prefix cache); the trainer's function then scores both
    replies' tokens in one row (the tool turn's tokens are not compared)."""
    tok = Tokenizer.from_gguf(find_smollm2_gguf())
    tool = tok.encode(f"<|im_end|>\n<|im_start|>tool\n{tool_text}<|im_end|>\n<|im_start|>assistant\n")
    params = cast(config, params)
    engine = make_engine(config, params, SAMPLES, aligned=aligned)
    half = NEW_TOKENS // 2
    rows, behaviour, spans = [], [], []
    for i, prompt in enumerate(prompts):
        first = engine.generate(
            [prompt], SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=half, seed=i, ignore_eos=True)
        )[0].outputs
        contexts = [[*prompt, *reply.tokens, *tool] for reply in first]
        second = engine.generate(
            contexts, SamplingParams(n=1, temperature=1.0, max_tokens=half, seed=100 + i, ignore_eos=True)
        )
        for reply, context, out in zip(first, contexts, second, strict=True):
            (answer,) = out.outputs
            rows.append([*context, *answer.tokens])
            behaviour += [np.asarray(reply.logprobs, np.float64), np.asarray(answer.logprobs, np.float64)]
            spans.append(
                [(len(prompt) - 1, len(prompt) - 1 + half), (len(context) - 1, len(context) - 1 + half)]
            )
    recomputed = trainer_logprobs(config, params, rows, aligned=aligned)
    trainer = np.concatenate([recomputed[i, a:b] for i, pair in enumerate(spans) for a, b in pair])
    delta = np.abs(trainer.astype(np.float64) - np.concatenate(behaviour))
    return {
        "tokens": float(delta.size),
        "equal": float(np.mean(delta == 0)),
        "p95": float(np.quantile(delta, 0.95)),
        "max": float(delta.max()),
        "prefix_cache_hit_tokens": float(engine.num_prefix_cache_hit_tokens),
    }


def engine_tokens_per_s(
    configs: dict[str, tuple[ModelConfig, bool]], params, prompt: list[int], *, rounds: int = 3
) -> dict[str, float]:
    """Warm `LLMEngine` alone per (config, aligned): 1 prompt x 8 samples x 64 tokens. The
    configs take turns (round-robin, so drifting machine load hits them alike); best of
    `rounds` each."""
    sp = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS, seed=0, ignore_eos=True)
    engines = {}
    for name, (config, aligned) in configs.items():
        engines[name] = make_engine(config, cast(config, params), SAMPLES, aligned=aligned)
        engines[name].generate([prompt], sp)  # compile every shape this job uses
    best = dict.fromkeys(configs, 0.0)
    for _ in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate([prompt], sp)
            best[name] = max(best[name], SAMPLES * NEW_TOKENS / (time.perf_counter() - start))
    return best


def run(say=print) -> dict[str, float]:
    base, params = load_gguf(find_smollm2_gguf())
    base = base.replace(max_position_embeddings=max(base.max_position_embeddings, 256))
    prompts = smollm2_prompts(PROMPTS)
    platform = jax.default_backend()
    bf16_request = base.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    f32 = base.replace(param_dtype="float32", compute_dtype="float32")
    bf16 = dtype_policy(bf16_request, platform, allow_bf16_on_cpu=True)  # forced, even on a CPU
    policy_bf16 = dtype_policy(bf16_request, platform)  # what a run asking for bfloat16 gets here
    say(f"SmolLM2-135M-Instruct on {platform}: {PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} tokens")
    info: dict[str, float] = {}
    for prefix, aligned in (("", False), ("aligned_", True)):
        for name, config in (("float32", f32), ("bfloat16", bf16)):
            m = measure_alignment(config, params, prompts, aligned=aligned)
            say(
                f"  {prefix + name:16s} |dlogprob| p50 {m['p50']:.2e}  p95 {m['p95']:.2e}  max {m['max']:.2e}  "
                f"over {int(m['tokens'])} tokens ({m['equal']:.0%} equal); ratio {m['ratio_min']:.4f}.."
                f"{m['ratio_max']:.4f}; engine call {m['engine_s']:.2f} s, trainer call {m['trainer_s']:.2f} s"
            )
            info.update({f"{prefix}{name}_{k}": v for k, v in m.items()})
            m = measure_multi_turn_alignment(config, params, prompts, "Result: 391", aligned=aligned)
            say(
                f"  {prefix + name:16s} multi-turn: p95 {m['p95']:.2e}  max {m['max']:.2e} over "
                f"{int(m['tokens'])} tokens of two replies ({m['equal']:.0%} equal; "
                f"{int(m['prefix_cache_hit_tokens'])} prompt tokens from the prefix cache)"
            )
            info.update({f"{prefix}{name}_multi_turn_{k}": v for k, v in m.items()})
    speed = engine_tokens_per_s(
        {
            "float32": (f32, False),
            "float32 aligned": (f32, True),
            "bfloat16 forced": (bf16, False),
            "bfloat16 forced aligned": (bf16, True),
            f"bfloat16 by policy ({policy_bf16.compute_dtype})": (policy_bf16, False),
        },
        params,
        prompts[0],
    )
    for name, tok_s in speed.items():
        say(
            f"  engine alone, warm, 1x8x64, {name:32s}: {tok_s:7.1f} tok/s = {tok_s / speed['float32']:.2f}x float32"
        )
    info.update({f"tok_s_{k.split(' (')[0].replace(' ', '_')}": v for k, v in speed.items()})
    return info


@pytest.mark.timeout(3600)
def test_alignment_smollm2(benchmark):
    def say(line: str) -> None:
        print(line, flush=True)

    info: dict[str, float] = {}
    print()
    benchmark.pedantic(lambda: info.update(run(say)), rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    write_bench_json(info)


def write_bench_json(info: dict[str, float]) -> None:
    """The figures as one JSON object (float32_p95, bfloat16_p95, ...), when RLAX_BENCH_JSON names a file."""
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        import json
        import pathlib

        from rlax_protocol.atomic_files import atomic_write_bytes

        atomic_write_bytes(pathlib.Path(target), json.dumps(info, indent=1).encode())


if __name__ == "__main__":
    write_bench_json(run(lambda line: print(line, flush=True)))
