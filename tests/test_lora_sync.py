"""A LoRA run's weight sync through a real parameter server: the trainer's pusher publishes the
base once (version 0) and then the adapters alone; a worker's `LoraBase` pulls the base once
and merges each version's adapters, giving the weights the trainer's merge gives."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
import pytest
from tiny_run import DEMO_CONFIG, TINY_RUN

import rlax_model
import rlax_protocol as rp
from rlax_core.config import LoraConfig
from rlax_inference.lora_weights import LoraBase
from rlax_model import lora
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol.lora_versions import LORA_BASE_SHA256, LORA_BASE_VERSION
from rlax_trainer.gang import Gang
from rlax_trainer.weight_push import WeightPusher

CONFIG = rlax_model.ModelConfig.tiny(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8
)
LORA = LoraConfig(rank=4, alpha=8)


def host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def base() -> Any:
    return host(rlax_model.init_params(CONFIG, jax.random.key(0), std=0.2))


def adapters_at(step: int) -> Any:
    """The adapters as after `step` updates: B off zero, different every step."""
    fresh = lora.init_adapters(CONFIG, LORA, jax.random.key(1))
    key = jax.random.key(100 + step)
    return host(
        {
            name: {
                "a": ad["a"],
                "b": 0.1 * step * jax.random.normal(jax.random.fold_in(key, i), ad["b"].shape),
            }
            for i, (name, ad) in enumerate(fresh.items())
        }
    )


def pusher(address: str) -> WeightPusher:
    client = ParamClient(address, timeout_s=10, client_id="trainer")
    return WeightPusher(Gang(), client, address=address, timeout_s=10, dtype="float32")


def test_the_base_crosses_once_and_each_version_carries_only_the_adapters(base: Any) -> None:
    with running_server(None, keep=1) as address, ParamClient(address, timeout_s=10) as client:
        push, worker = pusher(address), LoraBase(client.pull, "merged")
        for step in range(4):
            push.publish_adapters(step, lambda: base, lambda s=step: adapters_at(s), LORA.scale)
            if step == 0:
                continue  # version 0 is the base itself
            pulled = client.pull("latest")
            assert pulled is not None and pulled.version == step and pulled.metadata[LORA_BASE_VERSION] == 0
            pushed_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(pulled.tree))
            assert pushed_bytes == lora.adapter_bytes(adapters_at(step))
            params = worker.params(pulled, np.float32)
            want = lora.merge_adapters(base, adapters_at(step), LORA.scale)
            for name in LORA.target_names():
                moved = np.abs(np.asarray(want["layers"][name]) - base["layers"][name]).max()
                assert moved > 1e-3  # the weights moved: the comparison below can fail
                np.testing.assert_allclose(params["layers"][name], want["layers"][name], rtol=0, atol=1e-6)
            np.testing.assert_array_equal(params["embed"], base["embed"])
        assert worker.base_pulls == 1
        assert client.stat().versions == (0, 3)  # keep=1, and the base the newest names


def test_a_server_that_lost_its_versions_gets_the_base_again_before_the_adapters(base: Any) -> None:
    with running_server(None, keep=2) as address, ParamClient(address, timeout_s=10) as client:
        pusher(address).publish_adapters(5, lambda: base, lambda: adapters_at(5), LORA.scale)
        assert client.stat().versions == (0, 5)
        got = LoraBase(client.pull, "merged").params(client.pull(5), np.float32)  # type: ignore[arg-type]
        want = lora.merge_adapters(base, adapters_at(5), LORA.scale)
        np.testing.assert_allclose(got["layers"]["q_proj"], want["layers"]["q_proj"], rtol=0, atol=1e-6)


def test_adapters_naming_another_base_are_refused_by_the_worker(base: Any) -> None:
    with running_server(None, keep=2) as address, ParamClient(address, timeout_s=10) as client:
        pusher(address).publish_adapters(1, lambda: base, lambda: adapters_at(1), LORA.scale)
        pulled = client.pull(1)
        assert pulled is not None
        forged = type(pulled)(pulled.tree, 1, {**pulled.metadata, LORA_BASE_SHA256: "0" * 64})
        with pytest.raises(rp.ProtocolError, match="not the run's base"):
            LoraBase(client.pull).params(forged, np.float32)


def test_a_lora_checkpoint_refuses_to_resume_on_another_base(tmp_path: pathlib.Path) -> None:
    """A LoRA checkpoint holds adapters only: it records the base's SHA-256 and a trainer
    whose base differs (here: another init seed) refuses to resume it, naming both."""
    from rlax_core.config import load_config
    from rlax_trainer.trainer_process import TrainerLoop

    overrides = [*TINY_RUN, "trainer.sft_steps=0", "trainer.lora.rank=4", f"run.output_dir={tmp_path}"]
    for seed in (0, 0):  # a fresh start (checkpoint 0), then a resume on the same base
        loop = TrainerLoop(load_config(DEMO_CONFIG, [*overrides, f"run.seed={seed}"]))
        assert loop.base_sha256 is not None and len(loop.base_sha256) == 64
        loop.close()
    with pytest.raises(RuntimeError, match="adapters trained on a base with SHA-256"):
        TrainerLoop(load_config(DEMO_CONFIG, [*overrides, "run.seed=1"]))


def test_unmerged_a_worker_keeps_one_program_shape_from_the_base_version_on(base: Any) -> None:
    """`workers.lora_apply: unmerged`: the base version (which announces the layout) gets zero
    adapters attached, each adapter version its own; the engine never changes program shape,
    the worker that loaded version 0 pulls no base again, and the forward equals the merged
    weights' forward."""
    from rlax_inference import EngineConfig, LLMEngine

    tokens = np.array([[3, 17, 9, 41, 5, 22, 8, 30]], np.int32)
    positions = np.arange(8, dtype=np.int32)[None]
    with running_server(None, keep=4) as address, ParamClient(address, timeout_s=10) as client:
        push = pusher(address)
        for step in range(3):
            push.publish_adapters(step, lambda: base, lambda s=step: adapters_at(s), LORA.scale)
        unmerged, merged = LoraBase(client.pull, "unmerged"), LoraBase(client.pull, "merged")
        first = client.pull(0)
        assert first is not None
        at_base = unmerged.params(first, np.float32)
        assert at_base is not None and set(at_base["layers"]["lora"]) == set(LORA.target_names())
        engine = LLMEngine(CONFIG, at_base, EngineConfig(max_num_seqs=2, max_model_len=16, seed=0))
        for version in (1, 2):
            pulled = client.pull(version)
            assert pulled is not None
            attached = unmerged.params(pulled, np.float32)
            assert jax.tree.structure(attached) == jax.tree.structure(at_base)
            engine.update_weights(attached, version)  # refuses a tree of another shape
            want = merged.params(pulled, np.float32)
            got_logits = rlax_model.forward(attached, tokens, positions, config=CONFIG)[0]
            want_logits = rlax_model.forward(want, tokens, positions, config=CONFIG)[0]
            base_logits = rlax_model.forward(base, tokens, positions, config=CONFIG)[0]
            assert float(np.abs(np.asarray(want_logits) - np.asarray(base_logits)).max()) > 1e-3
            np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=2e-5)
        assert unmerged.base_pulls == 0  # it loaded version 0, the base, itself
        assert merged.base_pulls == 1


def test_rlax_eval_reads_a_lora_runs_newest_adapters_merged_onto_their_base(tmp_path: pathlib.Path) -> None:
    """`rlax eval`'s weights of a LoRA run (`load_run_params`): the newest version holds only
    adapters, so they are merged onto the base file it names, from the run's state folder."""
    from rlax_core.config import load_config, published_state_dir
    from rlax_data.task_from_config import build_task
    from rlax_inference.eval_process import load_run_params
    from rlax_model.model_from_config import initial_params

    overrides = [*TINY_RUN, "trainer.sft_steps=0", "trainer.lora.rank=4", "trainer.lora.alpha=8"]
    config = load_config(DEMO_CONFIG, [*overrides, f"run.output_dir={tmp_path}", "paramserver.storage=disk"])
    task = build_task(config)
    model_config, init = initial_params(config, task.tokenizer)
    base_tree = host(init)
    layout = LoraConfig(rank=4, alpha=8)
    fresh = lora.init_adapters(model_config, layout, jax.random.key(1))
    trained = host(
        {
            n: {"a": ad["a"], "b": 0.5 * jax.random.normal(jax.random.key(i), ad["b"].shape)}
            for i, (n, ad) in enumerate(fresh.items())
        }
    )
    with running_server(published_state_dir(config), keep=1) as address:
        push = pusher(address)
        for step in (0, 1, 2):
            push.publish_adapters(step, lambda: base_tree, lambda: trained, layout.scale)
        push.close()
    _, params, described = load_run_params(config, task.tokenizer)
    assert described == "published version 2 (LoRA on version 0)"
    want = lora.merge_adapters(base_tree, trained, layout.scale)
    for name in layout.target_names():
        assert np.abs(np.asarray(want["layers"][name]) - base_tree["layers"][name]).max() > 1e-3
        np.testing.assert_allclose(params["layers"][name], want["layers"][name], rtol=0, atol=1e-6)
