"""Entry points of `rlax <component>`: each builds one process from the run config by
calling into the package that owns it. Each first builds its component's typed configs
(`preflight`), so a config the component rejects raises `ConfigError` (exit code
`EXIT_CONFIG_ERROR`, never restarted) before anything is loaded or bound."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

from rlax_controller import preflight
from rlax_controller.config import ConfigError, RunConfig

__all__ = [
    "run_controller",
    "run_eval",
    "run_paramserver",
    "run_tool",
    "run_trainer",
    "run_verifier",
    "run_worker",
]

log = logging.getLogger("rlax")


def _select_platform(platform: str) -> None:
    # Must happen before JAX initialises a backend; an empty value keeps JAX's default.
    if platform:
        os.environ["JAX_PLATFORMS"] = platform


def _compile_cache(config: RunConfig) -> None:
    # A restarted trainer or worker reuses the executables its previous life compiled.
    import jax

    folder = config.run.jax_cache_dir or str(config.output_dir / "jax_cache")
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _exit_on_sigterm() -> None:
    # SIGTERM from the supervisor becomes SystemExit, so `finally` blocks close sockets.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_paramserver(config: RunConfig) -> int:
    from rlax_paramserver.cli import main

    server = preflight.paramserver_config(config)
    argv = ["--bind", server.bind, "--keep", str(server.keep), "--state-dir", str(server.state_dir)]
    return int(main(argv) or 0)


def run_verifier(config: RunConfig) -> int:
    from rlax_data.service import main

    return int(main(["--bind", config.verifier.address]) or 0)


def _scorer(config: RunConfig, task: Any) -> Any:
    if config.verifier.mode == "service":
        from rlax_data.service import RemoteVerifier

        task.verifier = RemoteVerifier(config.verifier.address, timeout_s=config.verifier.timeout_s)
    return task


def run_controller(config: RunConfig) -> int:
    from rlax_controller.controller import Controller

    _select_platform("cpu")  # the controller computes nothing on an accelerator
    _exit_on_sigterm()
    task = preflight.run_task(config)
    controller = Controller(
        config,
        source=task.prompt_source(),
        scorer=_scorer(config, task),
        eval_items=task.eval_items(),
        stop_token_ids=task.stop_token_ids,
        worker_addresses=config.workers.addresses,
    )
    try:
        return controller.run()
    finally:
        controller.close()


def run_trainer(config: RunConfig) -> int:
    from rlax_controller.trainer_service import run

    _select_platform(config.trainer.platform)  # before anything imports JAX
    preflight.learner_configs(config)
    preflight.task_and_model(config)
    _compile_cache(config)
    _exit_on_sigterm()
    return run(config)


def run_worker(config: RunConfig, index: int) -> int:
    if not 0 <= index < len(config.workers.addresses):
        raise ConfigError(
            f"rlax worker --index {index}: the config has {len(config.workers.addresses)} worker addresses"
        )
    _select_platform(config.workers.platform)  # before anything imports JAX
    preflight.engine_config(config)
    preflight.task_and_model(config)
    _compile_cache(config)
    if config.workers.implementation == "builtin":
        from rlax_controller.worker_service import run

        _exit_on_sigterm()
        return run(config, index)
    return _run_inference_worker(config, index)


def _run_inference_worker(config: RunConfig, index: int) -> int:
    """`rlax_inference.worker` (the `rlax-worker` entry point) with the run's model and engine."""
    import dataclasses
    import json

    from rlax_controller.fsutil import atomic_write_bytes
    from rlax_controller.models import build_model_config
    from rlax_controller.tasks import build_task
    from rlax_controller.worker_service import engine_config_fields
    from rlax_inference.worker import main

    model_config = build_model_config(config, build_task(config).tokenizer)
    folder = config.output_dir / "workers"
    model_json = json.dumps(dataclasses.asdict(model_config)).encode()
    model_file = atomic_write_bytes(folder / f"worker{index}-model.json", model_json)
    engine_file = atomic_write_bytes(
        folder / f"worker{index}-engine.json", json.dumps(engine_config_fields(config)).encode()
    )
    argv = [
        "--paramserver", config.paramserver.address,
        "--bind", config.workers.addresses[index],
        "--reload-staleness", str(config.workers.j),
        "--weights-poll-s", "0.05",
        "--model-config", str(model_file),
        "--engine-config", str(engine_file),
        "--worker-id", f"worker{index}",
    ]  # fmt: skip
    return int(main(argv) or 0)


def run_eval(config: RunConfig, *, checkpoint: str = "", out: str = "") -> int:
    from rlax_controller.evaluation import run

    return run(config, checkpoint=checkpoint, out=out)


def run_tool(name: str, argv: list[str]) -> int:
    if name == "curate":
        from rlax_data.curation.cli import main as curate_main

        return int(curate_main(argv) or 0)
    if name == "convert":
        from rlax_controller.convert import main as convert_main

        return int(convert_main(argv) or 0)
    raise ValueError(f"unknown tool {name!r}")
