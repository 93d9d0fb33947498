"""Every shipped run config validates, and the per-preset examples cover every preset."""

from __future__ import annotations

import collections
import importlib
import pathlib
from typing import Any

import pytest

from rlax_core import cli
from rlax_core.config import load_config
from rlax_data import verifier_process
from rlax_paramserver import paramserver_process
from rlax_trainer import PRESET_NAMES
from rlax_trainer.trainer_process import learner_config

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
FILES = sorted(CONFIGS.rglob("*.yaml"))


def heavy(path: pathlib.Path) -> bool:
    # A GGUF model's configs read its tokenizer and shapes from the GGUF file: tens of
    # seconds per component on loaded cores. `nox -s slow` checks those; the default
    # session checks every other shipped config through the same entry points.
    return load_config(path).model.source == "gguf"


def component_cases() -> list[Any]:
    cases = []
    for path in FILES:
        marks = [pytest.mark.slow] if heavy(path) else []
        cases.append(pytest.param(path, marks=marks, id=str(path.relative_to(CONFIGS))))
    return cases


@pytest.mark.parametrize("path", component_cases())
def test_config_validates_for_every_component(path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Each process `rlax launch` would start for this config reads it through its own entry
    point and accepts it, in this process: the controller, the trainer and every worker with
    `--check-config` (their typed configs, task, verifier, tokenizer and model shapes; no
    server is started), the parameter server its flags; the verifier service has a route
    for the run's task."""
    from rlax_controller.process_plan import build_specs, resolve_addresses  # where `rlax launch` builds them
    from rlax_core.config import dump_config

    config = resolve_addresses(load_config(path))
    learner_config(config, mode="rl")  # the trainer accepts the objective preset and sizes
    if config.trainer.sft_steps:
        learner_config(config, mode="sft")
    resolved = dump_config(config, tmp_path / "config.yaml")  # as the components get it
    checked = collections.Counter()
    for spec in build_specs(config, resolved, None):
        module, args = spec.argv[2], spec.argv[3:]
        if module == "rlax_core.cli":
            role, args = args[0], args[1:]
        else:
            role = {"rlax_paramserver": "paramserver"}[module]
        if role == "paramserver":  # a node with rlax-paramserver alone: flags, no run config
            server, _, _ = paramserver_process.parse_config(args)
            assert server.keep == config.paramserver.keep
        elif role == "verifier":  # the service reads no run config: its address, from flags
            assert args[args.index("--bind") + 1] == config.verifier.address
        else:
            command = cli.COMMANDS[role]
            main = getattr(importlib.import_module(command.module), command.function)
            assert main([*args, "--check-config"]) == 0, f"{spec.name} rejects {path.name}"
        checked[spec.role] += 1
    # The verifier: in-process (`verifier.mode: local`) the controller's check above built the
    # task's own; the service (`service`) serves the run's task by name.
    assert config.data.task in verifier_process.default_routes().routes, config.data.task
    assert checked["controller"] == 1 and checked["paramserver"] == 1
    assert checked["worker"] == config.workers.count and checked["trainer"] == config.trainer.hosts
    assert checked["verifier"] == (config.verifier.mode == "service")


def test_cosine_learning_rate_ends_with_the_run() -> None:
    """`trainer.optimizer.schedule: cosine` decays over the run's optimizer steps (run.steps x
    minibatches, after the warm-up) to lr x min_lr_ratio; by hand from the cosine
    lr_t = low + (lr - low) (1 + cos(pi t / T)) / 2 with T = 100 x 4 - 20 = 380."""
    from rlax_trainer.config import learning_rate_schedule

    config = load_config(
        CONFIGS / "demo.yaml",
        ["run.steps=100", "trainer.minibatches=4", "trainer.optimizer.lr=1e-3", "trainer.optimizer.schedule=cosine",
         "trainer.optimizer.min_lr_ratio=0.1", "trainer.optimizer.warmup_steps=20"],
    )  # fmt: skip
    schedule = learning_rate_schedule(learner_config(config, mode="rl").optimizer)
    assert float(schedule(20)) == pytest.approx(1e-3)
    assert float(schedule(20 + 190)) == pytest.approx(0.55e-3)  # halfway: (lr + low) / 2
    assert float(schedule(400)) == pytest.approx(1e-4)
    constant = learner_config(
        load_config(CONFIGS / "demo.yaml", ["trainer.optimizer.schedule=constant"]), mode="rl"
    )
    assert float(learning_rate_schedule(constant.optimizer)(10_000)) == pytest.approx(constant.optimizer.lr)


def test_one_example_per_preset() -> None:
    examples = {load_config(p).trainer.preset for p in (CONFIGS / "presets").glob("*.yaml")}
    assert examples == set(PRESET_NAMES)


def test_demo_is_the_documented_shape() -> None:
    demo = load_config(CONFIGS / "demo.yaml")
    assert demo.model.source == "tiny" and demo.workers.count == 2
    assert (demo.workers.j, demo.trainer.k) == (1, 2)
    assert demo.trainer.sft_steps > 0 and demo.trainer.preset == "grpo"


def test_smollm2_configs_share_the_measured_task() -> None:
    """Both SmolLM2 configs train the task whose starting pass rate docs/benchmarks.md reports, and
    the CPU one keeps to the CPU sizes its comments measure (float32, <= 2 x 8 x 64, remat)."""
    cpu = load_config(CONFIGS / "smollm2-cpu.yaml")
    accelerator = load_config(CONFIGS / "smollm2-accelerator.yaml")
    for config in (cpu, accelerator):
        assert config.model.source == "gguf"
        assert (config.data.task, config.data.task_args) == ("arithmetic", {"digits": 1, "style": "sentence"})
        assert config.data.temperature == 0.7  # the temperature the starting pass rate was measured at
    assert cpu.model.param_dtype == "float32" and cpu.trainer.remat == "full"
    assert cpu.data.prompts_per_step <= 2 and cpu.data.group_size == 8 and cpu.data.max_new_tokens <= 64
    assert cpu.workers.platform == cpu.trainer.platform == "cpu" and cpu.trainer.k <= 2
    assert accelerator.model.param_dtype == "bfloat16" and accelerator.trainer.publish_dtype == "bfloat16"
    assert accelerator.data.prompts_per_step * accelerator.data.group_size > 2 * 8
