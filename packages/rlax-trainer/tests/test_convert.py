"""`rlax convert`: the folders it writes load with transformers' Auto classes as they are and
give RLAX's token ids, chat rendering and greedy output."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest
import torch
import transformers

from rlax_trainer.convert import main

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _rlax_greedy(params, config, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation by plain full forwards (no cache: a reference, a few tokens)."""
    from rlax_model import forward

    ids = list(prompt)
    for _ in range(new_tokens):
        tokens = jnp.asarray([ids], jnp.int32)
        positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
        logits = forward(params, tokens, positions, config=config)[0]
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt) :]


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation, through EOS too (generate() would stop there)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.slow  # ~30-60 s on 2 shared cores: trainer state, orbax restore, two model loads
def test_to_hf_exports_a_run_checkpoint_with_its_tokenizer(tmp_path):
    from rlax_core.config import load_config
    from rlax_data.task_from_config import build_task
    from rlax_model.model_from_config import initial_params
    from rlax_trainer import Learner
    from rlax_trainer.checkpoint import CheckpointManager
    from rlax_trainer.trainer_process import learner_config

    overrides = [f"run.output_dir={tmp_path / 'run'}"]
    config = load_config(ROOT / "configs" / "demo.yaml", overrides)
    task = build_task(config)
    model_config, init = initial_params(config, task.tokenizer)
    # The checkpoint holds weights other than the initial ones, so the export must read it.
    trained = jax.tree.map(lambda x: x * 3.0, init)
    learner = Learner(model_config, learner_config(config, mode="rl"), init, seed=0)
    state = learner.state._replace(params={**learner.state.params, "policy": trained})
    manager = CheckpointManager(config.output_dir / "checkpoints" / "rl", asynchronous=False)
    manager.save(state, version=0)
    manager.close()

    out = tmp_path / "hf"
    assert (
        main(["to-hf", "--config", str(ROOT / "configs" / "demo.yaml"), "--out", str(out), *overrides]) == 0
    )

    ours = task.tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for record in task.eval_records()[:3]:
        prompt = task.encode_prompt(record)
        assert theirs(ours.BOS + record.prompt_text()).input_ids == prompt
        messages = [{"role": "user", "content": record.prompt_text()}]
        assert theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        ) == ours.render_chat(messages)
        assert _hf_greedy(model, prompt, 6) == _rlax_greedy(trained, model_config, prompt, 6)
    assert model.generation_config.eos_token_id == ours.eos_id
    assert model.generation_config.pad_token_id == ours.pad_id


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.mark.slow
def test_gguf_to_hf_smollm2_loads_and_matches_rlax(tmp_path):
    from rlax_core.gguf_file import find_smollm2_gguf
    from rlax_core.tokenizer import Tokenizer
    from rlax_model.gguf_import import load_gguf

    out = tmp_path / "smollm2"
    assert main(["gguf-to-hf", "--out", str(out)]) == 0  # ~100 s on 2 shared cores
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2"]
    ours = Tokenizer.from_gguf(find_smollm2_gguf())
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == ours.render_chat(messages)
        assert theirs(rendered).input_ids == ours.apply_chat_template(messages)
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)

    config, params = load_gguf(find_smollm2_gguf())
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = ours.apply_chat_template([{"role": "user", "content": prompt}])
        rlax = _rlax_greedy(params, config, ids, 4)
        assert _hf_greedy(model, ids, 4) == rlax, (prompt, ours.decode(rlax))
        # generate() with the folder's generation_config agrees too (stops at <|im_end|>).
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        assert hf[0, len(ids) :].tolist() == rlax[: len(hf[0]) - len(ids)]
    assert len(theirs) == ours.vocab_size


@pytest.mark.slow  # ~25 s alone on 2 cores (learner, orbax, engine, three HF model loads), like the test above
def test_a_lora_checkpoint_exports_as_peft_adapters_that_give_the_engines_greedy_tokens(tmp_path):
    """`rlax convert to-hf --peft`: peft loads the folder onto its HF base and greedy decoding
    gives the tokens RLAX's engine gives with the same adapters (applied unmerged, as a
    worker does) on 5 prompts; the default export of the same checkpoint is the merged model."""
    from peft import AutoPeftModelForCausalLM

    from rlax_core.config import load_config
    from rlax_data.task_from_config import build_task
    from rlax_inference import EngineConfig, LLMEngine, SamplingParams
    from rlax_model.lora import merge_adapters, with_adapters
    from rlax_model.model_from_config import initial_params
    from rlax_protocol.lora_versions import tree_sha256
    from rlax_trainer import Learner
    from rlax_trainer.checkpoint import CheckpointManager
    from rlax_trainer.trainer_process import learner_config

    overrides = [
        f"run.output_dir={tmp_path / 'run'}", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.intermediate_size=96", "trainer.sft_steps=0", "trainer.lora.rank=4",
        "trainer.lora.alpha=8",
    ]  # fmt: skip
    config = load_config(ROOT / "configs" / "demo.yaml", overrides)
    task = build_task(config)
    model_config, init = initial_params(config, task.tokenizer)
    learner = Learner(model_config, learner_config(config, mode="rl"), init, seed=0)
    fresh = learner.state.params["lora"]
    keys = jax.random.split(jax.random.key(7), len(fresh))
    trained = {  # B off zero, as after training: the adapters change the greedy tokens below
        name: {"a": ad["a"], "b": 2.0 * jax.random.normal(k, ad["b"].shape)}
        for k, (name, ad) in zip(keys, fresh.items(), strict=True)
    }
    manager = CheckpointManager(config.output_dir / "checkpoints" / "rl", asynchronous=False)
    manager.save(
        learner.state._replace(params={"lora": trained}),
        version=0,
        extra={"lora_base_sha256": tree_sha256(learner.host_base())},
    )
    manager.close()
    args = ["--config", str(ROOT / "configs" / "demo.yaml"), *overrides]
    assert main(["to-hf", "--peft", "--out", str(tmp_path / "peft"), *args]) == 0
    assert main(["to-hf", "--out", str(tmp_path / "merged"), *args]) == 0

    peft_model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft", dtype=torch.float32).eval()
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "peft" / "base", dtype=torch.float32
    )
    scale = config.trainer.lora.scale
    engine = LLMEngine(
        model_config,
        with_adapters(init, trained, scale),
        EngineConfig(max_num_seqs=2, max_model_len=32, seed=0),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    moved = 0
    for record in task.eval_records()[:5]:
        prompt = task.encode_prompt(record)
        ours = list(engine.generate([prompt], greedy)[0].outputs[0].tokens)
        assert _hf_greedy(peft_model, prompt, 6) == ours
        assert _hf_greedy(merged_model.eval(), prompt, 6) == ours
        assert ours == _rlax_greedy(merge_adapters(init, trained, scale), model_config, prompt, 6)
        moved += _hf_greedy(base_model.eval(), prompt, 6) != ours
    assert moved > 0  # the adapters changed what the model says: the comparisons above can fail
