"""`EngineSampler` on a multi-turn run: each sample is a trajectory that the worker's agent
loop runs in process (`rlax curate prefilter` and `rlax eval` measure what training sees),
started from the record that `render` gives as JSON."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from rlax_core.config import load_config
from rlax_data import ToolArithmeticTask
from rlax_data.task_from_config import build_task
from rlax_inference.eval_process import EngineSampler, load_run_params

ENDS = {"answer", "max_turns", "max_total_tokens", "length", "error"}


def sampler(tmp_path: pathlib.Path, *extra: str) -> EngineSampler:
    config = load_config(
        None,
        [
            "model.max_seq_len=48",
            "model.hidden_size=32",
            "model.num_heads=2",
            "model.num_kv_heads=1",
            "model.num_layers=1",
            "data.task=tool_arithmetic",
            "data.max_new_tokens=8",
            "eval.temperature=1.0",
            f"run.output_dir={tmp_path / 'run'}",
            *extra,
        ],
    )
    task = build_task(config)
    model_config, params, described = load_run_params(config, task.tokenizer)
    assert described == "initial weights"
    return EngineSampler(config, task, model_config, params, seed=3)


@pytest.fixture(scope="module")
def agent_sampler(tmp_path_factory: pytest.TempPathFactory) -> EngineSampler:
    return sampler(tmp_path_factory.mktemp("agent"), "agent.environment=calculator", "agent.max_turns=3")


def test_a_multi_turn_sampler_runs_trajectories_from_records(agent_sampler: EngineSampler) -> None:
    records = ToolArithmeticTask().generate(3, seed=7)
    assert agent_sampler.render is not None
    prompts = [agent_sampler.render(r) for r in records]
    assert [json.loads(p)["id"] for p in prompts] == [r.id for r in records]
    texts = agent_sampler(prompts, 4)
    assert [len(row) for row in texts] == [4, 4, 4]
    trajectories = list(agent_sampler.trajectories)
    assert len(trajectories) == 12
    for t in trajectories:
        assert 1 <= t["turns"] <= 3 and t["end"] in ENDS and t["tool_calls"] >= 0 and t["tool_errors"] >= 0
    # The untrained model writes calls (its alphabet has the brackets): trajectories go on past a turn.
    assert any(t["turns"] >= 2 for t in trajectories)
    # The texts are the last model turns, which at most one turn's token budget can hold.
    assert all(len(agent_sampler.task.encode_text(x)) <= 8 + 1 for row in texts for x in row)
    # Seeded per prompt: the same call gives the same trajectories.
    assert agent_sampler(prompts, 4) == texts
    assert agent_sampler.trajectories[12:] == trajectories


def test_a_multi_turn_sampler_wants_records_not_prompt_text(agent_sampler: EngineSampler) -> None:
    [record] = ToolArithmeticTask().generate(1, seed=7)
    with pytest.raises(ValueError, match="prompt 0: a multi-turn sampler takes records as JSON"):
        agent_sampler([record.prompt], 2)


def test_a_single_turn_sampler_takes_prompt_text(tmp_path: pathlib.Path) -> None:
    single = sampler(tmp_path)
    assert single.render is None
    [record] = ToolArithmeticTask().generate(1, seed=7)
    texts: Any = single([record.prompt], 3)
    assert len(texts) == 1 and len(texts[0]) == 3 and single.trajectories == []
