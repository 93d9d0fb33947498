"""Every option of a run is defined once, with one default: the components take the run
config's own structs (or their fields by the same name), never a second copy that could
drift (the trainer's learning rate was 1e-4 in the run config and 1e-6 in the trainer's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest

import rlax_core.config as run_config
from rlax_core.config import (
    ModelSection,
    OptimizerConfig,
    ParamServerSection,
    RunConfig,
    TrainerSection,
    UpdateOptions,
    WorkersSection,
)


def _defaults(cls: type) -> dict[str, Any]:
    """Field -> default of a msgspec struct or a dataclass (fields without one are left out)."""
    if issubclass(cls, msgspec.Struct):
        out = {}
        for f in msgspec.structs.fields(cls):
            if f.default is not msgspec.NODEFAULT:
                out[f.name] = f.default
            elif f.default_factory is not msgspec.NODEFAULT:
                out[f.name] = f.default_factory()
        return out
    return {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }


def _options(section: type) -> list[str]:
    """Dotted names of every option under a struct, nested structs expanded."""
    names = []
    for f in msgspec.structs.fields(section):
        if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
            names += [f"{f.name}.{inner}" for inner in _options(f.type)]
        else:
            names.append(f.name)
    return names


def test_every_option_of_the_run_has_one_dotted_name() -> None:
    options = _options(RunConfig)
    assert len(options) == len(set(options))
    assert "trainer.optimizer.lr" in options and "trainer.lr" not in options


def test_the_trainer_uses_the_run_configs_optimizer_and_update_options_themselves() -> None:
    from rlax_trainer import LearnerConfig
    from rlax_trainer import OptimizerConfig as TrainerOptimizerConfig

    assert TrainerOptimizerConfig is OptimizerConfig
    assert issubclass(LearnerConfig, UpdateOptions) and issubclass(TrainerSection, UpdateOptions)
    shared = {f.name for f in msgspec.structs.fields(UpdateOptions)}
    learner, section = _defaults(LearnerConfig), _defaults(TrainerSection)
    assert {name: learner[name] for name in shared} == {name: section[name] for name in shared}
    assert learner["optimizer"] == section["optimizer"] == OptimizerConfig()


def test_the_learner_of_a_run_takes_the_sections_values_unrenamed() -> None:
    from rlax_trainer.trainer_process import learner_config

    config = run_config.load_config(
        None,
        [
            "trainer.optimizer.lr=3e-5",
            "trainer.optimizer.schedule=cosine",
            "trainer.remat=dots_saveable",
            "trainer.minibatches=2",
            "run.steps=7",
        ],
    )
    learner = learner_config(config, mode="rl")
    assert learner.remat == "dots_saveable" and learner.minibatches == 2
    # decay_steps 0 is "the run's optimizer steps": run.steps x minibatches.
    assert learner.optimizer == msgspec.structs.replace(config.trainer.optimizer, decay_steps=14)


def test_the_engine_takes_its_defaults_and_the_runs_values_by_the_same_names() -> None:
    from rlax_inference.engine import EngineConfig
    from rlax_inference.engine_config import ENGINE_OPTIONS
    from rlax_inference.worker_process import WorkerConfig, engine_config_fields

    section, engine = _defaults(WorkersSection), _defaults(EngineConfig)
    assert {name: engine[name] for name in ENGINE_OPTIONS} == {name: section[name] for name in ENGINE_OPTIONS}
    config = run_config.load_config(None, ["workers.block_size=32", "workers.max_num_batched_tokens=4096"])
    fields = engine_config_fields(config)
    assert {name: fields[name] for name in ENGINE_OPTIONS} == {
        name: getattr(config.workers, name) for name in ENGINE_OPTIONS
    }
    worker = _defaults(WorkerConfig)
    for name in set(worker) & set(section):
        assert worker[name] == section[name], name


def test_the_parameter_server_defaults_equal_the_run_configs() -> None:
    from rlax_paramserver.config import ServerConfig

    server, section = _defaults(ServerConfig), _defaults(ParamServerSection)
    assert server["keep"] == section["keep"]


def test_the_rollout_scheduler_defaults_equal_the_run_configs() -> None:
    from rlax_controller.rollout_scheduler import RolloutSchedulerConfig

    scheduler = _defaults(RolloutSchedulerConfig)
    sections = {**_defaults(run_config.ControllerSection), **_defaults(run_config.DataSection)}
    # `lag` is the resolved lag (RunConfig.pinned_lag), where the section's -1 means "the most k
    # allows"; `lookahead_steps` the resolved lookahead (RunConfig.lookahead_steps), where -1
    # means "the lag, at least 1": 1 at the scheduler's default lag 0.
    for name in (set(scheduler) & set(sections)) - {"lag", "lookahead_steps"}:
        assert scheduler[name] == sections[name], name
    assert sections["lookahead_steps"] == -1 and scheduler["lookahead_steps"] == 1 and scheduler["lag"] == 0
    assert {"versions", "lookahead_steps", "dynamic_filter", "max_filter_draws"} <= set(scheduler) & set(
        sections
    )


def test_the_tiny_model_is_built_from_the_sections_shape_by_name() -> None:
    from rlax_core.tokenizer import CharTokenizer
    from rlax_model.model_from_config import TINY_SHAPE_FIELDS, build_model_config

    assert set(TINY_SHAPE_FIELDS) <= set(_defaults(ModelSection))
    config = run_config.load_config(None, ["model.hidden_size=48", "model.num_layers=3", "model.num_heads=6"])
    model = build_model_config(config, CharTokenizer())
    for name in TINY_SHAPE_FIELDS:
        assert getattr(model, name) == getattr(config.model, name), name


@pytest.mark.parametrize("old", ["trainer.lr", "model.d_model", "workers.max_batch_seqs"])
def test_an_old_field_name_says_where_its_value_goes_now(old: str) -> None:
    with pytest.raises(run_config.ConfigError, match=r"unknown config field .* \(it is `.*` now\)"):
        run_config.load_config(None, [f"{old}=1"])


def test_the_configuration_reference_is_generated_from_the_structs() -> None:
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--check"]) == 0, "docs/configuration.md is stale: python tools/config_reference.py"
    for name in (
        "trainer.optimizer.lr",
        "workers.block_size",
        "model.hidden_size",
        "launcher.health_check.period_s",
    ):
        assert f"| `{name}` |" in tool.DOCUMENT.read_text()
