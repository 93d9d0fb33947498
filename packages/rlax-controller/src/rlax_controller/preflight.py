"""Every component's typed config, built from the run config by the component's own code.

`rlax launch` calls `validate_components` before it starts any process, so a value that
a component would reject (a `micro_batch` that does not divide the minibatch, an unknown
attention backend, ...) stops the launch with that component's message. Each component's
entry point builds its configs through the same functions at start-up, so a component
started by hand with a bad config exits with `EXIT_CONFIG_ERROR` (which the supervisor
never restarts) instead of crashing in a loop.

The checks are not copies of the components' rules: each function constructs the
component's own config object (`rlax_trainer.LearnerConfig`, `rlax_inference.EngineConfig`,
`rlax_paramserver.ServerConfig`, the task and model) and only turns its `ValueError` into
a `ConfigError` that names the component.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from rlax_controller.config import ConfigError, RunConfig

__all__ = [
    "check_prompts_fit",
    "engine_config",
    "learner_configs",
    "paramserver_config",
    "run_task",
    "task_and_model",
    "validate_components",
]

T = TypeVar("T")


def _rejected_by(component: str, build: Callable[[], T]) -> T:
    """`build()`, with a component's `ValueError` (msgspec's `ValidationError` is one)
    reported as a `ConfigError` naming the component."""
    try:
        return build()
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"{component} rejects the config: {error}") from None


def run_task(config: RunConfig) -> Any:
    """The run's `tasks.RunTask` (prompts, tokenizer, verifier) from `data.*`."""
    from rlax_controller.tasks import build_task

    return _rejected_by("the task (data.*)", lambda: build_task(config))


def task_and_model(config: RunConfig) -> tuple[Any, Any]:
    """(`tasks.RunTask`, `rlax_model.ModelConfig`) of the run: the task, and the model
    shapes every process agrees on (`model.*`)."""
    from rlax_controller.models import build_model_config

    task = run_task(config)

    def model() -> Any:
        try:
            return build_model_config(config, task.tokenizer)
        except FileNotFoundError as error:  # a model file that is not there will not appear on restart
            raise ValueError(f"model.path: {error}") from None

    return task, _rejected_by("the model (model.*)", model)


def learner_configs(config: RunConfig) -> dict[str, Any]:
    """The trainer's `rlax_trainer.LearnerConfig`s: `rl`, and `sft` when `trainer.sft_steps`."""
    from rlax_controller.trainer_service import learner_config

    modes = ["rl", "sft"] if config.trainer.sft_steps else ["rl"]
    configs: dict[str, Any] = {}
    for mode in modes:
        configs[mode] = _rejected_by("the trainer", functools.partial(learner_config, config, mode=mode))
    return configs


def engine_config(config: RunConfig) -> Any:
    """The workers' `rlax_inference.EngineConfig` (both worker implementations use it)."""
    from rlax_controller.worker_service import engine_config_fields
    from rlax_inference.engine import EngineConfig

    return _rejected_by(
        "the inference engine (workers.*)", lambda: EngineConfig(**engine_config_fields(config))
    )


def paramserver_config(config: RunConfig) -> Any:
    """The parameter server's `rlax_paramserver.ServerConfig` as `rlax paramserver` runs it."""
    import pathlib

    from rlax_paramserver.config import ServerConfig

    state_dir = config.paramserver.state_dir or str(config.output_dir / "paramserver")
    return _rejected_by(
        "the parameter server (paramserver.*)",
        lambda: ServerConfig(
            bind=config.paramserver.address, keep=config.paramserver.keep, state_dir=pathlib.Path(state_dir)
        ),
    )


def check_prompts_fit(config: RunConfig, task: Any) -> None:
    """Every training and evaluation prompt must leave room for one generated token in
    `model.max_seq_len`: the engine refuses a longer one, and the controller would send
    its group again and again."""
    limit = config.model.max_seq_len
    longest, record_id = 0, ""
    for record in [*task.train_records(), *task.eval_records()]:
        length = len(task.encode_prompt(record))
        if length > longest:
            longest, record_id = length, record.id
    if longest >= limit:
        raise ConfigError(
            f"model.max_seq_len = {limit}: prompt {record_id!r} alone has {longest} tokens "
            "(no room to generate); raise model.max_seq_len or filter the data"
        )


def validate_components(config: RunConfig) -> None:
    """Build the typed config of every component a local launch starts, and check that
    the data fits the model; raises `ConfigError`."""
    task, _ = task_and_model(config)
    learner_configs(config)
    engine_config(config)
    paramserver_config(config)
    check_prompts_fit(config, task)
