"""Checks of a run config before `rlax launch` starts anything.

The controller's own checks (the task, the tokenizer, the parameter server's config,
prompts that fit the model) run here. The trainer's and the workers' typed configs
(`rlax_trainer.LearnerConfig`, `rlax_inference.EngineConfig`, the model's shapes) are
built by their own packages, which import JAX: the launcher asks each of them with
`rlax <role> --check-config` in a process of its own (run with the role's interpreter),
so the controller's process never imports JAX. The trainer's check starts JAX's backend of
`trainer.platform` there: a platform this machine lacks, or a `trainer.mesh` that its device
count (`xla_force_host_platform_device_count` on a CPU) cannot fill, stops the launch before
anything starts. A component started by hand runs the same checks at start-up and exits with
`EXIT_CONFIG_ERROR`, which the supervisor never restarts.
"""

from __future__ import annotations

import pathlib
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from rlax_controller.process_plan import rlax_command
from rlax_core.config import ConfigError, RunConfig, dump_config, paramserver_dirs, rejected_by

__all__ = [
    "check_components",
    "check_prompts_fit",
    "paramserver_config",
    "run_task",
    "validate_components",
]

CHECK_TIMEOUT_S = 300.0


def run_task(config: RunConfig) -> Any:
    """The run's `rlax_data.RunTask` (prompts, tokenizer, verifier) from `data.*`."""
    from rlax_data.task_from_config import build_task

    return rejected_by("the task (data.*)", lambda: build_task(config))


def paramserver_config(config: RunConfig) -> Any:
    """The parameter server's `rlax_paramserver.ServerConfig` as the launcher runs it."""
    from rlax_paramserver.config import ServerConfig

    state_dir, rest_dir = paramserver_dirs(config)
    return rejected_by(
        "the parameter server (paramserver.*)",
        lambda: ServerConfig(
            bind=config.paramserver.address,
            keep=config.paramserver.keep,
            state_dir=state_dir,
            rest_dir=rest_dir,
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


def check_components(config: RunConfig, roles: Sequence[tuple[str, list[str]]]) -> None:
    """Run `rlax ROLE --config RESOLVED --check-config [ARGS]` for each (role, args), all at
    once, each with its role's interpreter; raise `ConfigError` with the first rejection.
    The config they read lies in the system's temporary folder, never in the caller's."""
    with tempfile.TemporaryDirectory(prefix="rlax-check-") as tmp:
        path = dump_config(config, pathlib.Path(tmp) / "config.yaml")
        started = [
            (
                role,
                subprocess.Popen(
                    rlax_command(config, role, "--config", str(path), "--check-config", *args),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
            for role, args in roles
        ]
        failures: list[str] = []
        for role, process in started:
            try:
                _, err = process.communicate(timeout=CHECK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                failures.append(f"rlax {role} --check-config did not answer in {CHECK_TIMEOUT_S:.0f}s")
                continue
            if process.returncode != 0:
                lines = [line for line in err.strip().splitlines() if line.strip()]
                failures.append(
                    lines[-1] if lines else f"rlax {role} --check-config exited {process.returncode}"
                )
    if failures:
        raise ConfigError("; ".join(failures))


def validate_components(config: RunConfig, *, components: bool = True) -> None:
    """Check everything a local launch starts; raises `ConfigError`. `components=False`
    skips the trainer's and workers' own checks (the JAX-free part only)."""
    task = run_task(config)
    paramserver_config(config)
    check_prompts_fit(config, task)
    if components:
        check_components(config, [("trainer", []), ("worker", ["--index", "0"])])
