"""LoRA weight sync on SmolLM2-135M-Instruct: what a version costs on the wire and what a
worker's switch to it costs, adapter-only against full-parameter, side by side in one run.

    python packages/rlax-inference/benchmarks/bench_lora_sync.py     (or: nox -s bench -- -k lora_sync)

Setup: a real parameter server (a subprocess with a state folder, as a run starts it), the
trainer's own pusher (`WeightPusher`, bfloat16 on the wire: full versions, or a LoRA run's base
once and then adapters of rank 16 on every linear layer), and a worker's engine
(`LLMEngine`, float32) per way of applying them, switching version after version:

- full: pull the whole version, convert, `update_weights` (a full-parameter worker);
- LoRA merged: pull the adapters, merge them into the base (`LoraBase`), `update_weights`;
- LoRA unmerged: pull the adapters, attach them to the base (the low-rank path runs in every
  forward), `update_weights`.

Each worker loads version 0 (the base) first; switches are timed over `SWITCHES` versions,
over the socket (`local=False`: a worker on another host) and mapped from the state file
(`local=True`: the same host), median reported. Each engine's decode rate (8 samples x 64
tokens, warm, best of three) shows what the unmerged path costs on every token. Bytes per
version for ranks 1-16 follow from the adapters' shapes (the pushed bytes equal them:
tests/test_lora_sync.py).

RLAX_BENCH_JSON=FILE writes one JSON object: lora_push_bytes, full_push_bytes,
lora_switch_seconds, full_switch_seconds (over the socket; the merged LoRA worker, the
default), lora_unmerged_switch_seconds, their same-host twins (`*_local`), the ratios to
full (`*_switch_ratio*`, push_bytes_ratio, push_bytes_ratio_rank{1,4,8,16}) and the decode
rates and their ratios (`*_decode_tokens_per_s`, `*_decode_ratio`).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlax_core.config import LoraConfig
from rlax_inference import EngineConfig, LLMEngine, SamplingParams
from rlax_inference.lora_weights import LoraBase, as_params
from rlax_model import dtype_policy, find_smollm2_gguf, load_gguf
from rlax_model.lora import adapter_shapes, init_adapters, merge_adapters
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server_process
from rlax_protocol.atomic_files import atomic_write_bytes
from rlax_trainer.gang import Gang
from rlax_trainer.weight_push import WeightPusher

SWITCHES = 5
LORA = LoraConfig()  # the default: rank 8 on every linear layer


def trained_adapters(config: Any, step: int) -> Any:
    """Adapters as after `step` updates (B off zero)."""
    fresh = init_adapters(config, LORA, jax.random.key(0))
    key = jax.random.key(step)
    return jax.tree.map(np.asarray, {
        name: {"a": ad["a"], "b": 1e-3 * jax.random.normal(jax.random.fold_in(key, i), ad["b"].shape)}
        for i, (name, ad) in enumerate(fresh.items())
    })  # fmt: skip


def median_switch(
    address: str, engine_of: Any, versions: list[int], *, apply: str | None, local: bool
) -> float:
    """Median seconds from asking for a version to the engine holding its weights, over
    `versions` after the first (untimed: it may pull the base and compile the merge).
    `apply`: None (full versions), "merged" or "unmerged" (`LoraBase`); `engine_of(params)`
    makes the worker's engine from its first weights (the base version's)."""
    seconds = []
    with ParamClient(address, timeout_s=60, local=local) as client:
        base = LoraBase(client.pull, apply or "merged")
        first = client.pull(0)
        assert first is not None
        start_params = base.params(first, jnp.float32) if apply else None
        engine = engine_of(start_params if start_params is not None else as_params(first.tree, jnp.float32))
        for index, version in enumerate(versions):
            start = time.perf_counter()
            pulled = client.pull(version)
            assert pulled is not None
            params = base.params(pulled, jnp.float32) if apply else as_params(pulled.tree, jnp.float32)
            assert params is not None
            engine.update_weights(params, version)
            jax.block_until_ready(engine.runner.params)
            if index:
                seconds.append(time.perf_counter() - start)
        assert base.base_pulls == 0  # the base came as version 0, loaded first
    return statistics.median(seconds)


def decode_tokens_per_s(engine: Any) -> float:
    """Best of three: 8 samples x 64 tokens of one prompt, sampled (warm)."""
    sampling = SamplingParams(n=8, max_tokens=64, temperature=1.0)
    prompt = list(range(1, 40))
    engine.generate([prompt], sampling)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        out = engine.generate([prompt], sampling)
        tokens = sum(len(c.tokens) for o in out for c in o.outputs)
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def publish_versions(address: str, params: Any, model_config: Any, *, lora: bool) -> None:
    """Versions 0 .. SWITCHES + 1 as the trainer's pusher publishes them (bfloat16)."""
    client = ParamClient(address, timeout_s=120, client_id="trainer")
    pusher = WeightPusher(Gang(), client, address=address, timeout_s=120, dtype="bfloat16")
    for step in range(SWITCHES + 2):
        adapters = trained_adapters(model_config, step)
        if lora:
            pusher.publish_adapters(step, lambda: params, lambda a=adapters: a, LORA.scale)
        else:
            merged = merge_adapters(params, adapters, LORA.scale)
            pusher.publish(step, lambda m=merged: m)
    pusher.close()


def run(say: Any = print) -> dict[str, float]:
    model_config, params = load_gguf(find_smollm2_gguf())
    model_config = dtype_policy(model_config.replace(param_dtype="float32", compute_dtype="float32"))
    engines: dict[str, Any] = {}

    def engine_of(kind: str) -> Any:
        def make(first: Any) -> Any:
            if kind not in engines:  # one engine per kind, compiled and warm before any timing
                engines[kind] = LLMEngine(
                    model_config, first, EngineConfig(max_num_seqs=8, max_model_len=256, seed=0)
                )
                decode_tokens_per_s(engines[kind])
            return engines[kind]

        return make

    figures: dict[str, float] = {}
    versions = list(range(1, SWITCHES + 2))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("full", "lora"):
            folder = pathlib.Path(tmp) / kind
            with running_server_process(folder, keep=2 * SWITCHES + 2, args=["--no-fsync"]) as server:
                publish_versions(server.address, params, model_config, lora=kind == "lora")
                with ParamClient(server.address, timeout_s=60) as reader:
                    pulled = reader.pull(SWITCHES + 1)
                    assert pulled is not None
                    figures[f"{kind}_push_bytes"] = float(
                        sum(np.asarray(x).nbytes for x in jax.tree.leaves(pulled.tree))
                    )
                for apply in ("merged", "unmerged") if kind == "lora" else (None,):
                    name = "full" if apply is None else "lora" if apply == "merged" else "lora_unmerged"
                    for local in (False, True):
                        key = f"{name}_switch_seconds" + ("_local" if local else "")
                        figures[key] = median_switch(
                            server.address, engine_of(name), versions, apply=apply, local=local
                        )
                    figures[f"{name}_decode_tokens_per_s"] = decode_tokens_per_s(engines[name])
    for name in ("lora", "lora_unmerged"):
        for suffix in ("", "_local"):
            figures[f"{name}_switch_ratio{suffix}"] = (
                figures[f"{name}_switch_seconds{suffix}"] / figures[f"full_switch_seconds{suffix}"]
            )
        figures[f"{name}_decode_ratio"] = (
            figures[f"{name}_decode_tokens_per_s"] / figures["full_decode_tokens_per_s"]
        )
    figures["push_bytes_ratio"] = figures["lora_push_bytes"] / figures["full_push_bytes"]
    for rank in (1, 4, 8, 16):  # bfloat16 adapters of rank r on every linear layer, from their shapes
        shapes = adapter_shapes(model_config, LoraConfig(rank=rank, alpha=2 * rank))
        nbytes = 2 * sum(math.prod(shape) for ab in shapes.values() for shape in ab.values())
        figures[f"push_bytes_ratio_rank{rank}"] = nbytes / figures["full_push_bytes"]
    say(
        f"SmolLM2-135M, LoRA rank {LORA.rank} on {', '.join(LORA.target_names())}, bfloat16 on the wire; {SWITCHES} switches each"
    )
    say(
        f"  bytes per version : LoRA {figures['lora_push_bytes'] / 1e6:7.2f} MB   full {figures['full_push_bytes'] / 1e6:7.2f} MB   ratio {figures['push_bytes_ratio']:.4f}"
    )
    say(
        "  ratio by rank     : "
        + "  ".join(f"r{r} {figures[f'push_bytes_ratio_rank{r}']:.4f}" for r in (1, 4, 8, 16))
    )
    for suffix, where in (("", "over the socket"), ("_local", "same host, mapped")):
        full_s = figures[f"full_switch_seconds{suffix}"]
        say(
            f"  switch ({where:17s}): full {full_s:6.3f} s   LoRA merged {figures[f'lora_switch_seconds{suffix}']:6.3f} s "
            f"({figures[f'lora_switch_ratio{suffix}']:.3f}x)   unmerged {figures[f'lora_unmerged_switch_seconds{suffix}']:6.3f} s "
            f"({figures[f'lora_unmerged_switch_ratio{suffix}']:.3f}x)"
        )
    say(
        f"  decode 8x64 tok/s : full {figures['full_decode_tokens_per_s']:6.1f}   LoRA merged {figures['lora_decode_tokens_per_s']:6.1f} "
        f"({figures['lora_decode_ratio']:.2f}x)   unmerged {figures['lora_unmerged_decode_tokens_per_s']:6.1f} ({figures['lora_unmerged_decode_ratio']:.2f}x)"
    )
    return figures


def write_bench_json(figures: dict[str, float]) -> None:
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        atomic_write_bytes(pathlib.Path(target), json.dumps(figures, indent=1).encode())


def test_lora_sync_smollm2(benchmark: Any) -> None:
    figures: dict[str, float] = {}
    benchmark.pedantic(
        lambda: figures.update(run(lambda line: print(line, flush=True))), rounds=1, iterations=1
    )
    benchmark.extra_info.update(figures)
    write_bench_json(figures)


if __name__ == "__main__":
    write_bench_json(run(lambda line: print(line, flush=True)))
