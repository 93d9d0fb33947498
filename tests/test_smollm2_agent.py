"""SmolLM2-135M-Instruct learns to use a calculator on CPU: 20 GRPO steps of
`configs/smollm2-agent-cpu.yaml` through the real `rlax launch` (parameter server, trainer,
controller and one inference worker as local processes, the worker running each sample as a
multi-turn trajectory in the Hermes tool format) raise the reward and the rate of correct
tool use.

The task is tool_arithmetic's chat style ("What is 964 * 59?" -> "The answer is 56876.",
exact match on the last model turn's first line): a 3-digit by 2-digit product that a 135M
model cannot work out in its head, with one worked example conversation before the question.
`rlax curate prefilter` measured the model's start at a 0.0625 pass rate (32 prompts x 8
trajectories); `tool_ok_rate` counts trajectories whose call returned the answer and whose
reply used it. Figures: docs/benchmarks.md, "SmolLM2 learns to use a calculator".
"""

from __future__ import annotations

import pathlib
import statistics

import pytest
from test_smollm2_grpo import STEPS, launch

CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "smollm2-agent-cpu.yaml"


def first_and_last(train: list[dict], key: str) -> tuple[float, float]:
    values = [float(r.get(key, 0.0)) for r in train]
    return statistics.fmean(values[:5]), statistics.fmean(values[-5:])


@pytest.mark.slow
@pytest.mark.timeout(5400)  # launch() stops the run itself after 3600 s
def test_grpo_teaches_smollm2_to_use_a_calculator(tmp_path: pathlib.Path) -> None:
    train = launch(tmp_path / "run", config=CONFIG)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # Every step ran trajectories of more than one turn: the calculator was part of the run.
    assert all(float(r["turns_mean"]) > 1.0 for r in train), [r["turns_mean"] for r in train]
    for key in ("reward_mean", "tool_use_rate", "tool_ok_rate"):
        first, last = first_and_last(train, key)
        assert last > first, f"{key} did not rise: first 5 steps {first:.3f}, last 5 {last:.3f}"
    first, _ = first_and_last(train, "reward_mean")
    assert first > 0.0  # the task gives GRPO a signal from the start
