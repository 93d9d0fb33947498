"""Every shipped run config validates, and the per-preset examples cover every preset."""

from __future__ import annotations

import pathlib

import pytest

from rlax_controller.config import load_config
from rlax_controller.trainer_service import learner_config
from rlax_trainer import PRESET_NAMES

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
FILES = sorted(CONFIGS.rglob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(CONFIGS)) for p in FILES])
def test_config_validates_for_every_component(path: pathlib.Path) -> None:
    config = load_config(path)
    learner_config(config, mode="rl")  # the trainer accepts the objective preset and sizes
    if config.trainer.sft_steps:
        learner_config(config, mode="sft")


def test_one_example_per_preset() -> None:
    examples = {load_config(p).trainer.preset for p in (CONFIGS / "presets").glob("*.yaml")}
    assert examples == set(PRESET_NAMES)


def test_demo_is_the_documented_shape() -> None:
    demo = load_config(CONFIGS / "demo.yaml")
    assert demo.model.source == "tiny" and demo.workers.count == 2
    assert (demo.workers.j, demo.trainer.k) == (1, 2)
    assert demo.trainer.sft_steps > 0 and demo.trainer.preset == "grpo"
