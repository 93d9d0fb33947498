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
