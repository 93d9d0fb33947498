"""LoRA weight sync on SmolLM2-135M-Instruct: what a version costs on the wire and what a
worker's switch to it costs, adapter-only against full-parameter, side by side in one run.

    python packages/rlax-inference/benchmarks/bench_lora_sync.py     (or: nox -s bench -- -k lora_sync)

Setup: a real parameter server (a subprocess with a state folder, as a run starts it), the
trainer's own pusher (`WeightPusher`: full versions in `publish_dtype` bfloat16, or a LoRA
run's base once and then float32 adapters of rank 16 on every linear layer), and a worker's
engine (`LLMEngine`, float32) that switches version after version:

- full: pull the whole version, convert, `update_weights` (what a full-parameter worker does);
- lora: pull the adapters, merge them into the base it holds (`LoraBase`: the base pulled once,
  before the timed switches), `update_weights`.

Each is timed over `SWITCHES` versions, both over the socket (`local=False`: a worker on
another host) and mapped from the state file (`local=True`: the same host), median reported.
The merged engine decodes at the base's speed; the unmerged low-rank path is measured as a
forward pass of a 8x64 batch through the model with the adapters attached (`with_adapters`)
against the merged weights, to show what the merge saves on every decoding step.

RLAX_BENCH_JSON=FILE writes one JSON object: lora_push_bytes, full_push_bytes,
lora_switch_seconds, full_switch_seconds (over the socket), their same-host twins
(`*_local`), push_bytes_ratio, switch_seconds_ratio, lora_merge_seconds and
unmerged_forward_over_merged.
"""

from __future__ import annotations

import json
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
from rlax_model import dtype_policy, find_smollm2_gguf, forward, load_gguf
from rlax_model.lora import init_adapters, merge_adapters, with_adapters
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server_process
from rlax_protocol.atomic_files import atomic_write_bytes
from rlax_trainer.gang import Gang
from rlax_trainer.weight_push import WeightPusher

SWITCHES = 5
LORA = LoraConfig(rank=16, alpha=32)


def trained_adapters(config: Any, step: int) -> Any:
    """Adapters as after `step` updates (B off zero)."""
    fresh = init_adapters(config, LORA, jax.random.key(0))
    key = jax.random.key(step)
    return jax.tree.map(np.asarray, {
        name: {"a": ad["a"], "b": 1e-3 * jax.random.normal(jax.random.fold_in(key, i), ad["b"].shape)}
        for i, (name, ad) in enumerate(fresh.items())
    })  # fmt: skip


def median_switch(address: str, engine: LLMEngine, versions: list[int], *, lora: bool, local: bool) -> float:
    """Median seconds from asking for a version to the engine holding its weights."""
    seconds = []
    with ParamClient(address, timeout_s=60, local=local) as client:
        base = LoraBase(client.pull)
        dtype = engine.runner.params["embed"].dtype
        if lora:
            first = client.pull(versions[0])
            assert first is not None
            engine.update_weights(base.params(first, dtype), versions[0])  # the base, pulled once
        for version in versions[1:] if lora else versions:
            start = time.perf_counter()
            pulled = client.pull(version)
            assert pulled is not None
            params = base.params(pulled, dtype) if lora else as_params(pulled.tree, dtype)
            engine.update_weights(params, version)
            jax.block_until_ready(engine.runner.params)
            seconds.append(time.perf_counter() - start)
        assert base.base_pulls == (1 if lora else 0)
    return statistics.median(seconds)


def forward_seconds(params: Any, config: Any) -> float:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (8, 64)), jnp.int32)
    positions = jnp.tile(jnp.arange(64, dtype=jnp.int32), (8, 1))
    run = jax.jit(lambda p: forward(p, tokens, positions, config=config)[0])
    jax.block_until_ready(run(params))  # compile
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(run(params))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(say: Any = print) -> dict[str, float]:
    model_config, params = load_gguf(find_smollm2_gguf())
    model_config = dtype_policy(model_config.replace(param_dtype="float32", compute_dtype="float32"))
    engine = LLMEngine(model_config, params, EngineConfig(max_num_seqs=8, max_model_len=256, seed=0))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))  # compiled, warm
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("full", "lora"):
            folder = pathlib.Path(tmp) / kind
            with running_server_process(folder, keep=2 * SWITCHES + 2, args=["--no-fsync"]) as server:
                client = ParamClient(server.address, timeout_s=120, client_id="trainer")
                pusher = WeightPusher(Gang(), client, address=server.address, timeout_s=120, dtype="bfloat16")
                for step in range(SWITCHES + 1):
                    if kind == "full":
                        merged = merge_adapters(params, trained_adapters(model_config, step), LORA.scale)
                        pusher.publish(step, lambda m=merged: m)
                    else:
                        pusher.publish_adapters(
                            step, lambda: params, lambda s=step: trained_adapters(model_config, s), LORA.scale
                        )
                with ParamClient(server.address, timeout_s=60) as reader:
                    pulled = reader.pull(SWITCHES)
                    assert pulled is not None
                    figures[f"{kind}_push_bytes"] = float(
                        sum(np.asarray(x).nbytes for x in jax.tree.leaves(pulled.tree))
                    )
                versions = list(range(SWITCHES + 1))
                for local in (False, True):
                    key = f"{kind}_switch_seconds" + ("_local" if local else "")
                    figures[key] = median_switch(
                        server.address, engine, versions, lora=kind == "lora", local=local
                    )
                pusher.close()
    figures["push_bytes_ratio"] = figures["lora_push_bytes"] / figures["full_push_bytes"]
    figures["switch_seconds_ratio"] = figures["lora_switch_seconds"] / figures["full_switch_seconds"]
    figures["switch_seconds_ratio_local"] = (
        figures["lora_switch_seconds_local"] / figures["full_switch_seconds_local"]
    )
    adapters = jax.tree.map(jnp.asarray, trained_adapters(model_config, 1))
    merge = jax.jit(merge_adapters, static_argnums=2)
    jax.block_until_ready(merge(params, adapters, LORA.scale))
    start = time.perf_counter()
    jax.block_until_ready(merge(params, adapters, LORA.scale))
    figures["lora_merge_seconds"] = time.perf_counter() - start
    merged_s = forward_seconds(merge(params, adapters, LORA.scale), model_config)
    unmerged_s = forward_seconds(with_adapters(params, adapters, LORA.scale), model_config)
    figures["unmerged_forward_over_merged"] = unmerged_s / merged_s
    say(f"SmolLM2-135M, LoRA rank {LORA.rank} on {', '.join(LORA.target_names())}; {SWITCHES} switches each")
    say(
        f"  bytes per version : LoRA {figures['lora_push_bytes'] / 1e6:8.2f} MB   full {figures['full_push_bytes'] / 1e6:8.2f} MB   ratio {figures['push_bytes_ratio']:.4f}"
    )
    for suffix, where in (("", "over the socket"), ("_local", "same host, mapped")):
        lora_s, full_s = figures[f"lora_switch_seconds{suffix}"], figures[f"full_switch_seconds{suffix}"]
        say(
            f"  switch ({where:17s}): LoRA {lora_s:6.3f} s   full {full_s:6.3f} s   ratio {lora_s / full_s:.3f}"
        )
    say(
        f"  merge alone {figures['lora_merge_seconds']:.3f} s; unmerged forward (8x64) = {figures['unmerged_forward_over_merged']:.2f}x merged"
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
