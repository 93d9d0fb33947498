"""Every shipped run config validates, and the per-preset examples cover every preset."""

from __future__ import annotations

import pathlib

import pytest

from rlax_core.config import load_config
from rlax_trainer import PRESET_NAMES
from rlax_trainer.trainer_process import learner_config

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
FILES = sorted(CONFIGS.rglob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(CONFIGS)) for p in FILES])
def test_config_validates_for_every_component(path: pathlib.Path) -> None:
    config = load_config(path)
    learner_config(config, mode="rl")  # the trainer accepts the objective preset and sizes
    if config.trainer.sft_steps:
        learner_config(config, mode="sft")


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
    """Both SmolLM2 configs train the task whose starting pass rate README.md reports, and
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
